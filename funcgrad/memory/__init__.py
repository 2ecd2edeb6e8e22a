"""Memory: what a compiled step allocates, and how to cut it (concepts 17 and 20)."""
from funcgrad.memory.remat import RematPlan as RematPlan
from funcgrad.memory.remat import plan_remat as plan_remat
from funcgrad.memory.remat import remat as remat
from funcgrad.memory.remat import remat_sequential as remat_sequential
