"""Memory of the backward pass: what it keeps, and ways to keep less."""
from funcgrad.memory.scan import checkpointed_scan as checkpointed_scan
