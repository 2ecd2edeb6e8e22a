"""Memory you can see and cut (concepts 17 and 20): the memory report of a compiled step,
rematerialisation that lowers what XLA allocates, and checkpointed scans."""
from funcgrad.memory.checkpointing import RematPlan as RematPlan
from funcgrad.memory.checkpointing import plan_remat as plan_remat
from funcgrad.memory.checkpointing import remat as remat
from funcgrad.memory.checkpointing import remat_sequential as remat_sequential
from funcgrad.memory.report import MemoryReport as MemoryReport
from funcgrad.memory.report import ResidualRow as ResidualRow
from funcgrad.memory.report import memory_report as memory_report
from funcgrad.memory.scan import checkpointed_scan as checkpointed_scan
from funcgrad.memory.segments import recompute_fraction as recompute_fraction
from funcgrad.memory.segments import segment_plan as segment_plan
