"""The SFT / DPO trees' section of the config reference (`docs/config.md`)."""

from __future__ import annotations

from posttrain.config.sft import DPOConfig, SFTConfig

__all__ = ["sft_markdown_reference"]


def sft_markdown_reference() -> str:
    """The SFT / DPO section of `docs/config.md` (appended to the RL reference)."""
    from posttrain.config.docs import all_keys, format_value

    out = ["", "# SFT and DPO trainers (`posttrain sft`, `posttrain dpo`, `python -m posttrain.trainer.fsdp_sft_trainer`)",
           "", "Their own tree: verl's `sft_trainer.yaml` keys (DPO adds TRL's names). Keys marked (posttrain) are ours.",
           "", "| key | type | default | meaning |", "|---|---|---|---|"]
    seen = set()
    dpo_only = ("data.train_files", "data.val_files", "data.prompt_key", "data.chosen_key", "data.rejected_key",
                "data.on_bad_row", "data.self_pairs.", "dpo.", "use_prefix_grouper")
    for cls, only in ((SFTConfig, None), (DPOConfig, dpo_only)):
        for key, info in all_keys(cls).items():
            if info.is_section or (only is None and key in seen):
                continue
            if only is not None and not key.startswith(only):
                continue
            label = f"`{key}` (DPO)" if only is not None else f"`{key}` (SFT, DPO)"
            default = format_value(info.default).replace("|", "\\|")
            out.append(f"| {label} | {info.type.replace('|', chr(92) + '|')} | `{default}` | {info.doc} |")
            seen.add(key)
    return "\n".join(out) + "\n"
