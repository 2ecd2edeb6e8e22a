"""Debugging gradients: the graph (`trace`), why a gradient is zero (`explain_grads`),
taps, the first NaN (`find_nonfinite`), dead ReLUs and `backward`."""
