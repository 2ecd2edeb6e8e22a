#!/bin/sh
# The data-parallel checks for a machine with a GPU and many CPU cores (run from the repo root,
# results under $1, default benchmarks/results): the one-device mesh step against the plain
# step on the GPU; the multi-process tests and benchmarks/parallel.py on CPU processes (gloo),
# on cores not shared with other jobs; then the stress script for what time is left.
OUT=${1:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 FUNCGRAD_NO_VERSION_WARNING=1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== GPU: one device through the mesh path vs the plain step"
python3 benchmarks/parallel.py --processes 1 --steps 200 --out "$OUT/parallel_gpu.json"
echo "== CPU: the multi-process tests"
JAX_PLATFORMS=cpu timeout 300 python3 -m pytest tests/parallel -q -p no:cacheprovider \
    --noconftest --durations=0 2>&1 | tail -40
echo "== CPU: steps per second on 1, 2, 4 processes"
JAX_PLATFORMS=cpu python3 benchmarks/parallel.py --steps 50 --out "$OUT/parallel_cpu.json"
echo "== CPU: stress"
JAX_PLATFORMS=cpu python3 benchmarks/parallel_stress.py -n "${STRESS_RUNS:-50}" \
    --max-seconds "${STRESS_SECONDS:-150}" --out "$OUT/parallel_stress.json" | tail -12
