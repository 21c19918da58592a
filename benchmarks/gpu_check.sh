#!/usr/bin/env bash
# One call on a GPU machine: install smartckpt from this checkout (and a folder of wheels carried
# with it), then run the CUDA tests and the benchmarks that fill the GPU rows of the documents,
# each under its own time limit, inside one overall budget, and write what they found into
# RESULTS_DIR: result files in the format of benchmarks/results/ (docs/benchmarks.md), named as
# the documents' GPU rows expect them (*-gpu.json). Copy those into benchmarks/results/ and run
# `python benchmarks/render_docs.py` to fill the rows.
#
#   bash benchmarks/gpu_check.sh RESULTS_DIR               # the GPU check (CUDA)
#   bash benchmarks/gpu_check.sh RESULTS_DIR --cpu-smoke   # the same steps on the CPU, tiny sizes
#                                                          # (or GPU_CHECK_DEVICE=cpu)
#
# Steps (GPU_CHECK_STEPS, in this order; default "tests step_cost loop_wait pinned bench"):
#   tests       the CUDA tests: kill and resume bit for bit, through the API and zero-code
#   step_cost   benchmarks/step_cost.py, API and zero-code: the monitoring cost, no save
#               -> step_cost-gpu.json
#   loop_wait   benchmarks/loop_wait.py --model bench: one save's loop wait from the loop's
#               clock, smartckpt against DCP async_save -> loop_wait-gpu.json
#   pinned      benchmarks/pinned_copy.py: device-to-host copies into pageable memory, the
#               registered private staging and the registered RAM slot -> pinned_copy-gpu.json
#   bench       smartckpt bench -> bench-gpu.json
#   throughput  benchmarks/throughput.py --model bench: throughput with the default policy and
#               its saves against none -> throughput-gpu.json. The policy's first save comes 90 s
#               in and each cycle lasts its interval: 6-10 minutes, so it is a call of its own:
#               GPU_CHECK_STEPS=throughput GPU_CHECK_BUDGET=570 bash benchmarks/gpu_check.sh DIR
#
# The machine needs Python with smartckpt's runtime dependencies (torch, numpy, typer, rich,
# psutil, pyyaml, xxhash; pytest for the tests) and nothing from the network: zstandard, often
# missing there, comes as a wheel in GPU_CHECK_WHEELS (default: .whl/ beside benchmarks/, see
# ../shared/recipes/gpu-check.md for the pip download line). Nothing is downloaded.
#
# RESULTS_DIR stays flat and holds at most 8 files: gpu_check.log (every step's output), pytest.xml,
# the result files of the steps that ran, and summary.md, written last.
#
# Settings (environment): PYTHON (python3), GPU_CHECK_BUDGET (seconds for everything, default
# 480 on CUDA, 330 for the CPU dry run), GPU_CHECK_WORKDIR (where checkpoints are written: a fresh folder under it; default
# $TMPDIR or /tmp), GPU_CHECK_WHEELS, GPU_CHECK_PARAMS (bench model size; default 4e8, ~4.8 GB of
# state, less when the work disk is short), GPU_CHECK_MODEL_PARAMS (loop_wait and throughput: the
# bench model's size, default 1e8 as on the CPU), GPU_CHECK_BATCH (their batch, default 4096 on
# CUDA), BENCH_GIT_COMMIT and BENCH_GIT_DIRTY (0/1: the commit the result files name, where the
# checkout has no .git to ask).
#
# One failing step never stops the others (no `set -e`); each step's exit code is in the summary:
# 124 means it ran into its time limit, "skipped" that the budget had no time left for it.
set -u

usage() { echo "usage: bash benchmarks/gpu_check.sh RESULTS_DIR [--cpu-smoke]" >&2; exit 2; }
ALL_STEPS="tests step_cost loop_wait pinned bench throughput"
[ $# -ge 1 ] || usage
RESULTS=$1
DEVICE=${GPU_CHECK_DEVICE:-cuda}
if [ "${2:-}" = "--cpu-smoke" ]; then DEVICE=cpu; elif [ $# -ge 2 ]; then usage; fi
case $DEVICE in cpu | cuda) ;; *) echo "gpu_check: GPU_CHECK_DEVICE must be cpu or cuda, not '$DEVICE'" >&2; exit 2 ;; esac

REPO=$(cd "$(dirname "$0")/.." && pwd)
WANT=${GPU_CHECK_STEPS:-tests step_cost loop_wait pinned bench}
for w in $WANT; do
    case " $ALL_STEPS " in *" $w "*) ;; *) echo "gpu_check: GPU_CHECK_STEPS: no step '$w' (steps: $ALL_STEPS)" >&2; exit 2 ;; esac
done
# The commit the result files name: the checkout's, when git can tell.
if git -C "$REPO" rev-parse HEAD >/dev/null 2>&1; then
    BENCH_GIT_COMMIT=$(git -C "$REPO" rev-parse HEAD)
    BENCH_GIT_DIRTY=$([ -z "$(git -C "$REPO" status --porcelain --untracked-files=no -- smartckpt_cli hooks benchmarks pyproject.toml constraints ':(exclude)benchmarks/results' ':(exclude)benchmarks/render_docs.py' ':(exclude)benchmarks/sections.py' ':(exclude)benchmarks/gpu_check_summary.py')" ] && echo 0 || echo 1)
fi
export BENCH_GIT_COMMIT BENCH_GIT_DIRTY
PY=${PYTHON:-python3}
# the steps run in the work directory: a relative interpreter path is made absolute (not resolved:
# a virtual environment's python is a link that must stay one)
case $PY in /*) ;; */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac
WHEELS=${GPU_CHECK_WHEELS:-$REPO/.whl}
mkdir -p "$RESULTS" || exit 2
RESULTS=$(cd "$RESULTS" && pwd)
LOG=$RESULTS/gpu_check.log
: >"$LOG"
START=$SECONDS
WORK=$(mktemp -d "${GPU_CHECK_WORKDIR:-${TMPDIR:-/tmp}}/smartckpt-gpu-check.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT
STEPS=() # "name|exit code|seconds|time limit" per step, for the summary

say() { echo "gpu_check: $(( SECONDS - START )) s  $*" | tee -a "$LOG"; }

# step NAME LIMIT RESERVE CMD...: CMD in $WORK under `timeout`, its output into the log. It gets
# LIMIT seconds, or less: whatever the budget has left once RESERVE seconds are kept for the steps
# after it.
step() {
    local name=$1 limit=$2 reserve=$3
    shift 3
    local left=$(( BUDGET - (SECONDS - START) - reserve ))
    (( left < limit )) && limit=$left
    if (( limit < 10 )); then
        say "$name: skipped, the budget has no time left"
        STEPS+=("$name|skipped|0|0")
        return
    fi
    say "$name: start (limit ${limit} s)"
    echo "===== $name: $*" >>"$LOG"
    local t0=$SECONDS
    (cd "$WORK" && timeout -k 10 "$limit" "$@") >>"$LOG" 2>&1
    local rc=$?
    say "$name: exit code $rc after $(( SECONDS - t0 )) s"
    STEPS+=("$name|$rc|$(( SECONDS - t0 ))|$limit")
}

# T_*: a step's own time limit; R_*: the least time kept for it while earlier steps run, so
# that a slow step cannot eat the later ones (the bench writes its JSON after each part).
if [ "$DEVICE" = cuda ]; then
    BUDGET=${GPU_CHECK_BUDGET:-480}
    PARAMS=${GPU_CHECK_PARAMS:-4e8}
    MODEL_PARAMS=${GPU_CHECK_MODEL_PARAMS:-1e8}
    BATCH=${GPU_CHECK_BATCH:-4096}
    BENCH_ARGS=(--reps 1 --rounds 2 --every 10)
    TEST_SELECT=(-m cuda)
    # every file with tests marked cuda (grep -l 'mark.cuda' tests/*.py); named, so that no other
    # test module (moto, transformers...) has to import here
    TEST_FILES=(tests/test_device_resume.py tests/test_cuda_step_path.py tests/test_optim_zoo.py tests/test_dtypes.py)
    STEP_ARGS=()
    LOOP_ARGS=(--model bench --params "$MODEL_PARAMS" --batch "$BATCH" --rounds 3)
    TP_ARGS=(--model bench --params "$MODEL_PARAMS" --batch "$BATCH" --cycles 1 --a-share 0.5)
    PINNED_ARGS=(--gb 2 --repeats 5)
    T_INSTALL=90 T_TESTS=120 T_STEP_COST=150 T_LOOP_WAIT=150 T_PINNED=60 T_BENCH=300 T_THROUGHPUT=540
    R_TESTS=45 R_STEP_COST=60 R_LOOP_WAIT=90 R_PINNED=20 R_BENCH=180 R_THROUGHPUT=480
else # the dry run: tiny sizes, the same steps
    BUDGET=${GPU_CHECK_BUDGET:-330}
    PARAMS=${GPU_CHECK_PARAMS:-3e6}
    BENCH_ARGS=(--reps 1 --rounds 1 --every 0.5)
    TEST_SELECT=()
    TEST_FILES=(tests/test_device_resume.py)
    STEP_ARGS=(--pairs 3 --block-seconds 0.3)
    LOOP_ARGS=(--model small --threads 1 --rounds 1 --before 5 --after 5)
    TP_ARGS=(--model small --threads 1 --cycles 1 --chunk 1)
    PINNED_ARGS=(--gb 0.05 --repeats 3)
    T_INSTALL=90 T_TESTS=120 T_STEP_COST=150 T_LOOP_WAIT=60 T_PINNED=30 T_BENCH=90 T_THROUGHPUT=400
    R_TESTS=40 R_STEP_COST=60 R_LOOP_WAIT=20 R_PINNED=10 R_BENCH=30 R_THROUGHPUT=250
fi
wanted() { case " $WANT " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# reserve_after NAME: the time kept for the wanted steps after NAME
reserve_after() {
    local after=0 sum=0 s r
    [ "$1" = install ] && after=1
    for s in $ALL_STEPS; do
        if [ "$s" = "$1" ]; then after=1; continue; fi
        if (( after )) && wanted "$s"; then r="R_${s^^}"; sum=$(( sum + ${!r} )); fi
    done
    echo "$sum"
}

# ---------------------------------------------------------------- the machine
say "device $DEVICE, budget $BUDGET s, work dir $WORK, results $RESULTS"
{
    echo "===== machine"
    uname -a
    command -v nvidia-smi >/dev/null && nvidia-smi -L && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    nproc
    free -g 2>/dev/null
    df -h "$WORK"
    "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())'
} >>"$LOG" 2>&1

# ---------------------------------------------------------------- install (offline)
# Into a folder of its own, first on PYTHONPATH: the tests then run against the installed package
# (hooks included), as a user has it, not against the checkout's source tree.
SITE=$WORK/site
install() {
    set -e
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        # a wheel for another Python (the CPU dry run on a machine with another version) is
        # no failure where zstandard is installed already
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl \
            || "$PY" -c 'import zstandard; print("wheels not installed; zstandard", zstandard.__version__, "is here already")'
    else
        echo "no wheels in $WHEELS: zstandard must already be installed"
    fi
    # built from a clean copy: a build/ folder left in the checkout could carry stale modules
    mkdir -p "$WORK/src"
    tar -C "$REPO" --exclude=./.venv --exclude=./.git --exclude=./build --exclude=./.whl \
        --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$WORK/src" -xf -
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" "$WORK/src"
    PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} "$PY" -c 'import smartckpt_cli, smartckpt_cli.hooks, zstandard, xxhash, typer, rich, psutil, yaml, numpy, torch; print("installed", smartckpt_cli.__file__)'
}
export -f install
export PY SITE WHEELS REPO WORK
step install "$T_INSTALL" "$(reserve_after install)" bash -c install
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PATH=$SITE/bin:$PATH PYTHONUNBUFFERED=1

# ---------------------------------------------------------------- the CUDA tests
# A copy of tests/ (and pyproject.toml: markers, options) with no source tree beside it, so the
# children import the installed package.
if wanted tests; then
    mkdir -p "$WORK/suite" && cp -r "$REPO/tests" "$REPO/pyproject.toml" "$WORK/suite/"
    step tests "$T_TESTS" "$(reserve_after tests)" bash -c 'cd suite && "$0" -m pytest -p no:cacheprovider -q -ra "$@"' \
        "$PY" "${TEST_SELECT[@]}" --junitxml="$RESULTS/pytest.xml" "${TEST_FILES[@]}"
fi

# ---------------------------------------------------------------- the monitoring cost, no save
if wanted step_cost; then
    step step_cost "$T_STEP_COST" "$(reserve_after step_cost)" "$PY" "$REPO/benchmarks/step_cost.py" \
        --device "$DEVICE" "${STEP_ARGS[@]}" --json "$RESULTS/step_cost-gpu.json"
fi

# ---------------------------------------------------------------- one save, from the loop's clock
if wanted loop_wait; then
    step loop_wait "$T_LOOP_WAIT" "$(reserve_after loop_wait)" "$PY" "$REPO/benchmarks/loop_wait.py" \
        --device "$DEVICE" "${LOOP_ARGS[@]}" --workdir "$WORK" --json "$RESULTS/loop_wait-gpu.json"
fi

# ---------------------------------------------------------------- pinned staging
if wanted pinned; then
    step pinned "$T_PINNED" "$(reserve_after pinned)" "$PY" "$REPO/benchmarks/pinned_copy.py" \
        --device "$DEVICE" "${PINNED_ARGS[@]}" --json "$RESULTS/pinned_copy-gpu.json"
fi

# ---------------------------------------------------------------- the bench
if wanted bench; then
    # ~6 checkpoints of the state on disk at once at most (every contender's previous one, the
    # one being written, smartckpt's two): a smaller model when the work disk is short.
    FREE_KB=$(df -Pk "$WORK" | awk 'NR == 2 {print $4}')
    read -r PARAMS STATE_GB < <("$PY" -c "import sys; p = int(min(float(sys.argv[1]), int(sys.argv[2]) * 1024 / 12 / 7)); print(p, round(p * 12 / 1e9, 2))" "$PARAMS" "$FREE_KB")
    say "bench: $PARAMS parameters (~$STATE_GB GB of state with AdamW), $(( FREE_KB >> 20 )) GiB free in $WORK"
    step bench "$T_BENCH" "$(( $(reserve_after bench) + 5 ))" "$PY" -m smartckpt_cli.cli.app bench --device "$DEVICE" \
        --params "$PARAMS" "${BENCH_ARGS[@]}" --workdir "$WORK" --json "$RESULTS/bench-gpu.json"
fi

# ---------------------------------------------------------------- throughput with the default policy
if wanted throughput; then
    step throughput "$T_THROUGHPUT" 5 "$PY" "$REPO/benchmarks/throughput.py" --device "$DEVICE" \
        "${TP_ARGS[@]}" --workdir "$WORK" --json "$RESULTS/throughput-gpu.json"
fi

# ---------------------------------------------------------------- summary (last)
rm -f "$RESULTS"/*.tmp
TOTAL=$(( SECONDS - START ))
printf '%s\n' "${STEPS[@]}" >"$WORK/steps.txt"
"$PY" "$REPO/benchmarks/gpu_check_summary.py" --results "$RESULTS" --steps "$WORK/steps.txt" \
    --device "$DEVICE" --seconds "$TOTAL" --budget "$BUDGET" >>"$LOG" 2>&1 \
    || { echo "# GPU check: the summary script failed; see gpu_check.log" >"$RESULTS/summary.md"; cat "$WORK/steps.txt" >>"$RESULTS/summary.md"; }
say "done in $TOTAL s: $RESULTS/summary.md"
cat "$RESULTS/summary.md"
