"""Memory you can see and cut: the memory report of a compiled step (and, from other modules,
rematerialisation and checkpointed scans)."""
from funcgrad.memory.report import MemoryReport as MemoryReport
from funcgrad.memory.report import ResidualRow as ResidualRow
from funcgrad.memory.report import memory_report as memory_report
