"""`agent apply RUN`: the run's winners as one kernels module next to the model and a patch
that routes the model through it.

    command.py  apply_run: what is written where       winners.py  which candidate per region
    merge.py    the candidates merged into one module   rename.py   scope-aware renaming for it
    routing.py  install(), the module's runtime routing patch.py    the block added to the model
"""

from agent.apply.command import ApplyResult, apply_run
from agent.apply.merge import kernels_module_text
from agent.apply.patch import patched_lines, unified_patch
from agent.apply.winners import CandidateSkipped, Winner

__all__ = ["ApplyResult", "CandidateSkipped", "Winner", "apply_run", "kernels_module_text", "patched_lines",
           "unified_patch"]
