"""The tool-call cold start: `posttrain sft` on `posttrain prep tool-arithmetic` rows (verl's multi-turn
SFT keys) runs on a tiny random model and learns: the validation loss falls."""

from __future__ import annotations

from helpers.sft import tiny_common
from posttrain.commands.prep import main as prep
from posttrain.data.tool_arithmetic import SFT_KEYS


def test_tiny_cold_start_on_tool_traces_lowers_the_validation_loss(tmp_path):
    from posttrain.config.sft_load import load_sft_config
    from posttrain.trainer.sft_trainer import SFTTrainer

    data = tmp_path / "task"
    assert prep(["tool-arithmetic", "--output", str(data), "--tools", "calculator", "--n-train", "16",
                 "--n-test", "4"]) == 0
    config = load_sft_config(overrides=[f"data.train_files={data / 'train.parquet'}",
                                        f"data.val_files={data / 'test.parquet'}", *SFT_KEYS,
                                        *tiny_common(tmp_path, ["data.max_length=1024", "trainer.total_epochs=8", "optim.lr=3e-3",
                                                                "trainer.test_freq=16", "trainer.save_freq=-1"])])
    trainer = SFTTrainer(config)
    before = trainer.validate()["val/loss"]
    history = trainer.fit()
    assert len(history) == 16
    assert history[-1]["val/loss"] < before - 0.5, (before, history[-1]["val/loss"])
