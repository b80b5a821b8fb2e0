"""The stages a policy is composed of, one module each (their native twins are in native/engine/stages/)."""

from __future__ import annotations

from typing import Any, Dict, List, Type

from ..policies import Stage
from .budget_entropy import EntropyBudget
from .budget_pyramid import PyramidBudget
from .budget_uniform import UniformBudget
from .fate_drop import DropFate
from .fate_host import HostFate
from .fate_summarise import SummariseFate
from .prefill_dense import DensePrefill
from .prefill_sparse import SparsePrefill
from .schedule_every import EverySchedule
from .schedule_freeze import FreezeSchedule
from .schedule_latent import LatentSchedule
from .schedule_prompt import PromptSchedule
from .score_accumulated import AccumulatedScore
from .score_recency import RecencyScore
from .score_window import WindowScore

STAGES: Dict[str, Type[Stage]] = {
    cls.name: cls
    for cls in (UniformBudget, PyramidBudget, EntropyBudget, RecencyScore, WindowScore, AccumulatedScore,
                PromptSchedule, EverySchedule, FreezeSchedule, LatentSchedule, DropFate, SummariseFate, HostFate, DensePrefill,
                SparsePrefill)
}



def server_stats(llm: Any) -> Dict[str, Dict[str, Any]]:
    """What each stage of a context's policy shows of its state, by stage name (`pykvcache serve`'s KV stats)."""
    res: Dict[str, Dict[str, Any]] = {}
    for name in llm.kv_policy.describe()["stages"].values():
        stage = STAGES.get(name)
        shown = stage.server_stats(llm) if stage is not None else None
        if shown is not None:
            res[name] = shown
    return res


def server_stats_total(name: str, blocks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One stage's blocks of several sequences as one (counts added up)."""
    return STAGES[name].server_stats_total(blocks)


__all__ = [cls.__name__ for cls in STAGES.values()] + ["STAGES", "server_stats", "server_stats_total"]
