"""Every probe case: imports the case-group modules in the issue's order, which fills CASES (name -> class,
function, cheap) in the order the probe runs and reports them.
"""

from __future__ import annotations

from tools.probe import (nonfinite, code_execution, reruns, coercions, lost_state,  # registration order: CASES' order
                         serve, late, rewards, damaged, signals, conventions)
from tools.probe.registry import CASES

GROUPS = (nonfinite, code_execution, reruns, coercions, lost_state, serve, late, rewards, damaged, signals, conventions)
__all__ = ["CASES", "GROUPS"]
