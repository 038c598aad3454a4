import numpy as np

def network_simplex(
    real: int,
    src: np.ndarray,
    dst: np.ndarray,
    cap: np.ndarray,
    cost: np.ndarray,
    flow: np.ndarray,
    state: np.ndarray,
    parent: np.ndarray,
    pred: np.ndarray,
    dir: np.ndarray,
    depth: np.ndarray,
    first: np.ndarray,
    next: np.ndarray,
    prev: np.ndarray,
    pi: np.ndarray,
    max_pivots: int,
) -> tuple[int, int]: ...
def longest_path(
    pred_ptr: np.ndarray, pred_idx: np.ndarray, times: np.ndarray, start: np.ndarray, end: np.ndarray
) -> None: ...
