"""Expert-load prediction (DESIGN 4.1): sliding-window mean of the last measured iterations.

Expert loads change smoothly between iterations, so the planners place experts for the next
iteration from a prediction built out of the last `window` measurements. window = 1 is
"mimic the previous iteration" (replicate mode); FSSDP uses window = 5.

Every rank feeds the tracker the same all-reduced loads, so every rank predicts the same
loads and plans the same placement.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from megatron_patches.placement.types import PlacementError, check_int, check_loads

__all__ = ["LoadTracker"]


class LoadTracker:
    """Keeps the last `window` measured loads of all MoE layers and predicts the next ones.

    Attributes:
        num_layers: L, MoE layers tracked.
        num_experts: E, experts per layer.
        window: w, iterations averaged by `predict`.
    """

    def __init__(self, num_layers: int, num_experts: int, window: int = 5) -> None:
        self.num_layers = check_int(num_layers, "LoadTracker num_layers", 1)
        self.num_experts = check_int(num_experts, "LoadTracker num_experts", 1)
        self.window = check_int(window, "LoadTracker window", 1)
        self._history: deque[np.ndarray] = deque(maxlen=self.window)  # int64 [L, E] each, oldest first
        self._observed = 0

    @property
    def num_observed(self) -> int:
        """Number of iterations observed so far (not capped by the window)."""
        return self._observed

    def observe(self, loads_LE) -> None:
        """Record one iteration's measured loads, int [L, E] (tokens routed per expert)."""
        loads_LE = check_loads(loads_LE, "loads_LE", 2)
        if loads_LE.shape != (self.num_layers, self.num_experts):
            raise PlacementError(
                f"observed loads have shape {loads_LE.shape}, expected ({self.num_layers}, {self.num_experts})"
            )
        self._history.append(loads_LE)
        self._observed += 1

    def predict(self) -> np.ndarray:
        """Predicted loads of the next iteration; float64 [L, E].

        The mean of the last min(w, observed) measurements. Before any observation every
        expert gets load 1.0 (uniform): the planners only use the ordering and proportions of
        loads, and uniform loads make them fall back to an even plan.
        """
        if not self._history:
            return np.ones((self.num_layers, self.num_experts), dtype=np.float64)
        return np.mean(np.stack(self._history), axis=0)

    def state_dict(self) -> dict:
        """Everything needed to resume prediction after a checkpoint (plain numpy / ints)."""
        if self._history:
            history = np.stack(self._history)
        else:
            history = np.zeros((0, self.num_layers, self.num_experts), dtype=np.int64)
        return {"observed": self._observed, "history_loads": history}

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict()`; with a smaller window only the newest loads are kept."""
        history = check_loads(state["history_loads"], "history_loads", 3)
        if history.shape[1:] != (self.num_layers, self.num_experts):
            raise PlacementError(
                f"saved load history has layers x experts {history.shape[1:]}, "
                f"expected ({self.num_layers}, {self.num_experts})"
            )
        self._history.clear()
        self._history.extend(history)
        self._observed = int(state["observed"])
