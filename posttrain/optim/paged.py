"""Float32 AdamW whose moments live in a file between uses (``*.fsdp_config.optimizer_offload`` on a
one-process CPU run): the host room's `PagedTensors` hold them, this optimizer steps one parameter at a time."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from posttrain.host.paging import PagedTensors

__all__ = ["PagedAdamW"]


class PagedAdamW(torch.optim.AdamW):
    """AdamW whose moments live in a file paged out of memory between uses (`PagedTensors`).

    `step` updates one parameter at a time, with torch's own AdamW step on a group holding that one
    parameter, then pages its moments out: at most one parameter's moments are in memory at once,
    instead of all of them (8 bytes a parameter) on top of what the update holds. The update is
    torch's (the same numbers as ``torch.optim.AdamW``), the state dict is torch's (checkpoints are
    interchangeable); moments created elsewhere are copied into the file: torch creates them at a
    parameter's first step (copied right after it), a checkpoint load replaces them (copied as it ends).
    """

    def __init__(self, params: Any, *, directory: str, **kwargs: Any):
        super().__init__(params, **kwargs)
        self._directory = directory
        self._params = [p for group in self.param_groups for p in group["params"]]
        self._slot = {p: i for i, p in enumerate(self._params)}
        self._files: dict[str, PagedTensors] = {}  # one file per moment ("exp_avg", "exp_avg_sq", ...)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups, hooks = self.param_groups, (self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks)
        # this step's hooks ran once around it; not again around each parameter's
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
        try:
            for group in groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    self.param_groups = [{**group, "params": [p]}]  # hyper-parameters as they are now (lr schedule)
                    super().step()
                    self._page_out(p)
        finally:
            self.param_groups = groups
            self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = hooks
        return loss

    def _page_out(self, p: torch.nn.Parameter) -> None:
        """``p``'s moments moved into their files (when not there yet) and dropped from memory."""
        state, i = self.state[p], self._slot[p]
        for key, value in state.items():
            if key == "step" or not isinstance(value, torch.Tensor):
                continue  # the step counter stays in memory
            if key not in self._files:
                self._files[key] = PagedTensors([q.detach() for q in self._params], self._directory,
                                                what=f"AdamW's {key}")
            state[key] = self._files[key].store(i, value)

    def page_out(self) -> None:
        """Every moment dropped from memory (after a checkpoint read them all)."""
        for paged in self._files.values():
            paged.page_out()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then the loaded moments moved into the files and paged out."""
        super().load_state_dict(state_dict)
        for p in self._params:
            if self.state.get(p):
                self._page_out(p)
