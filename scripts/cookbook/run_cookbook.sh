#!/usr/bin/env bash
# Run UNCHANGED tinker-cookbook programs against a Tinker-compatible server, in this order:
#   rl_loop   tinker_cookbook.recipes.rl_loop              GRPO-style loop on GSM8K
#   sl_loop   tinker_cookbook.recipes.sl_loop              supervised loop (no_robots stand-in)
#   dpo       tinker_cookbook.recipes.preference.dpo.train DPO: forward_backward_custom + reference
#                                                          compute_logprobs (hh-rlhf stand-in)
#   distill   tinker_cookbook.recipes.distillation.on_policy_distillation
#                                                          teacher = create_sampling_client(base_model=,
#                                                          model_path=sl_loop's final sampler checkpoint)
#   math_rl   tinker_cookbook.recipes.math_rl.train        the tinker_cookbook.rl.train framework on GSM8K,
#                                                          async (max_steps_off_policy=1)
#
#   bash scripts/cookbook/run_cookbook.sh BASE_URL [LOG_DIR]
#   e.g. bash scripts/cookbook/run_cookbook.sh http://127.0.0.1:8000 runs/cookbook
#
# Needs scripts/cookbook/setup_cookbook.sh first (venv + offline caches). The programs are the installed
# package's own modules, configured only through their chz command-line fields and environment variables.
#
# LOG_DIR (default <repo>/runs/cookbook) gets NAME/ for each program (its log_path: config.json,
# metrics.jsonl, checkpoints.jsonl, logs.log) and NAME.out (stdout+stderr). Both are removed first on
# every run: a log_path holding a checkpoints.jsonl makes the programs resume from it (on a path of an
# earlier server).
#
# Why model_name=Qwen/Qwen3-4B-Instruct-2507: the loops pick their renderer with
# model_info.get_recommended_renderer_name(model_name), which raises for any model name outside the
# cookbook's table (e.g. HuggingFaceTB/SmolLM2-135M-Instruct), and they have no renderer_name field.
# That table entry maps to the "qwen3_instruct" renderer, plain ChatML (<|im_start|>role\n...<|im_end|>
# with <|im_end|> as the stop token), which is token-for-token SmolLM2's own chat template. The offline
# hub cache holds SmolLM2's tokenizer (and weights) under that repo id, so the client tokenizes with
# SmolLM2's vocabulary; the server must serve SmolLM2 for base_model "Qwen/Qwen3-4B-Instruct-2507"
# (it does so by itself when started with the same HF_HOME and HF_HUB_OFFLINE=1, see COOKBOOK_HF_ENV).
#
# Environment knobs (defaults suit a 2-core CPU and a 135M model):
#   STEPS=2                 max_steps for both loops
#   LORA_RANK=8             lora_rank for both loops
#   SAVE_EVERY=1            save_every (1: a mid-run save_state at step 1, besides the final save)
#   RL_BATCH_SIZE=2 RL_GROUP_SIZE=4 RL_MAX_TOKENS=64 RL_LEARNING_RATE=4e-5
#   RL_LOSS_FN=importance_sampling  (the recipe default, stable_reinforce, is not supported by this server;
#                           also used by math_rl)
#   SL_BATCH_SIZE=4 SL_MAX_LENGTH=512 SL_LEARNING_RATE=1e-4
#   DPO_BATCH_SIZE=4 DPO_LEARNING_RATE=1e-5
#   DISTILL_GROUPS=2 DISTILL_GROUP_SIZE=2 DISTILL_MAX_TOKENS=64 DISTILL_LEARNING_RATE=1e-4
#   TEACHER_CHECKPOINT      distill's teacher (default: sl_loop's final sampler_path from this run)
#   MATH_RL_STEPS=3 MATH_RL_OFF_POLICY=1   (math_rl also takes RL_BATCH_SIZE/RL_GROUP_SIZE/RL_MAX_TOKENS)
#   RL_EXTRA_ARGS, SL_EXTRA_ARGS, DPO_EXTRA_ARGS, DISTILL_EXTRA_ARGS, MATH_RL_EXTRA_ARGS
#                           more key=value fields, appended last (so they win)
#   ONLY="dpo distill"      run only these (names above; rl and sl also mean rl_loop and sl_loop)
#   LOOP_TIMEOUT=1800       seconds per program
#   TINKER_API_KEY          default tml-local
#   COOKBOOK_VENV, COOKBOOK_CACHE, COOKBOOK_MODEL_NAME   as in setup_cookbook.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
BASE_URL="$1"
LOG_DIR="${2:-$repo/runs/cookbook}"
mkdir -p "$LOG_DIR"
LOG_DIR="$(cd "$LOG_DIR" && pwd)"

COOKBOOK_VENV="${COOKBOOK_VENV:-$repo/.venv-cookbook}"
COOKBOOK_CACHE="${COOKBOOK_CACHE:-$repo/.cache-cookbook}"
COOKBOOK_MODEL_NAME="${COOKBOOK_MODEL_NAME:-Qwen/Qwen3-4B-Instruct-2507}"
STEPS="${STEPS:-2}"
LORA_RANK="${LORA_RANK:-8}"
SAVE_EVERY="${SAVE_EVERY:-1}"
LOOP_TIMEOUT="${LOOP_TIMEOUT:-1800}"

log() { printf '[run_cookbook] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

py="$COOKBOOK_VENV/bin/python"
[[ -x "$py" ]] || die "no $py: run scripts/cookbook/setup_cookbook.sh first"
hf_home="$COOKBOOK_CACHE/hf"
[[ -d "$hf_home/datasets/openai___gsm8k" ]] || die "no offline caches in $hf_home: run setup_cookbook.sh first"

# The offline environment (a server started with the same HF_HOME and HF_HUB_OFFLINE=1 resolves
# base_model=$COOKBOOK_MODEL_NAME to the SmolLM2 snapshot in that cache).
export HF_HOME="$hf_home"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_HUB_DISABLE_TELEMETRY=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export TINKER_API_KEY="${TINKER_API_KEY:-tml-local}"
export TINKER_COOKBOOK_RUNS_DIR="$LOG_DIR"  # the loops' default log root; we pass log_path anyway
export NO_PROXY="127.0.0.1,localhost,::1${NO_PROXY:+,$NO_PROXY}" no_proxy="127.0.0.1,localhost,::1${no_proxy:+,$no_proxy}"
export PYTHONUNBUFFERED=1

common=(
    "base_url=$BASE_URL"
    "model_name=$COOKBOOK_MODEL_NAME"
    "lora_rank=$LORA_RANK"
    "max_steps=$STEPS"
    "save_every=$SAVE_EVERY"
)
# shellcheck disable=SC2206  # word splitting of the *_EXTRA_ARGS lists is intended
rl_args=(
    "${common[@]}"
    "log_path=$LOG_DIR/rl_loop"
    "batch_size=${RL_BATCH_SIZE:-2}"
    "group_size=${RL_GROUP_SIZE:-4}"
    "max_tokens=${RL_MAX_TOKENS:-64}"
    "learning_rate=${RL_LEARNING_RATE:-4e-5}"
    "loss_fn=${RL_LOSS_FN:-importance_sampling}"
    ${RL_EXTRA_ARGS:-}
)
# shellcheck disable=SC2206
sl_args=(
    "${common[@]}"
    "log_path=$LOG_DIR/sl_loop"
    "batch_size=${SL_BATCH_SIZE:-4}"
    "max_length=${SL_MAX_LENGTH:-512}"
    "learning_rate=${SL_LEARNING_RATE:-1e-4}"
    ${SL_EXTRA_ARGS:-}
)

# shellcheck disable=SC2206
dpo_args=(
    "base_url=$BASE_URL"
    "model_name=$COOKBOOK_MODEL_NAME"
    "max_steps=$STEPS"
    "log_path=$LOG_DIR/dpo"
    "dataset=hhh"
    "batch_size=${DPO_BATCH_SIZE:-4}"
    "max_length=${SL_MAX_LENGTH:-512}"
    "learning_rate=${DPO_LEARNING_RATE:-1e-5}"
    "behavior_if_log_dir_exists=delete"
    ${DPO_EXTRA_ARGS:-}
)
# shellcheck disable=SC2206
distill_args=(
    "${common[@]}"
    "log_path=$LOG_DIR/distill"
    "teacher_model=$COOKBOOK_MODEL_NAME"
    "dataset=deepmath"
    "groups_per_batch=${DISTILL_GROUPS:-2}"
    "group_size=${DISTILL_GROUP_SIZE:-2}"
    "max_tokens=${DISTILL_MAX_TOKENS:-64}"
    "learning_rate=${DISTILL_LEARNING_RATE:-1e-4}"
    "eval_every=0"
    "behavior_if_log_dir_exists=delete"
    ${DISTILL_EXTRA_ARGS:-}
)
MATH_RL_STEPS="${MATH_RL_STEPS:-3}"
# shellcheck disable=SC2206
math_rl_args=(
    "base_url=$BASE_URL"
    "model_name=$COOKBOOK_MODEL_NAME"
    "lora_rank=$LORA_RANK"
    "save_every=$SAVE_EVERY"
    "max_steps=$MATH_RL_STEPS"
    "log_path=$LOG_DIR/math_rl"
    "env=gsm8k"
    "groups_per_batch=${RL_BATCH_SIZE:-2}"
    "group_size=${RL_GROUP_SIZE:-4}"
    "max_tokens=${RL_MAX_TOKENS:-64}"
    "learning_rate=${RL_LEARNING_RATE:-4e-5}"
    "loss_fn=${RL_LOSS_FN:-importance_sampling}"
    "max_steps_off_policy=${MATH_RL_OFF_POLICY:-1}"
    "eval_every=0"
    "behavior_if_log_dir_exists=delete"
    ${MATH_RL_EXTRA_ARGS:-}
)

# Check what a finished program left in its log_path: >= STEPS metric rows and a final checkpoint.
check_outputs() {
    "$py" - "$1" "$3" "$2" <<'EOF'
import json, sys
from pathlib import Path
d, steps, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
problems = []
metrics = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines() if l.strip()] if (d / "metrics.jsonl").exists() else []
if len(metrics) < steps:
    problems.append(f"metrics.jsonl has {len(metrics)} rows, want >= {steps}")
ckpts = [json.loads(l) for l in (d / "checkpoints.jsonl").read_text().splitlines() if l.strip()] if (d / "checkpoints.jsonl").exists() else []
final = [c for c in ckpts if c.get("name") == "final"]
if not final or not final[-1].get("state_path") or not final[-1].get("sampler_path"):
    problems.append(f"no final checkpoint with state_path and sampler_path in checkpoints.jsonl ({ckpts})")
for m in metrics:  # the first 16 metrics that are not timings or token counts
    shown = [k for k in m if not k.startswith(("time/", "tokens/", "progress/"))][:16]
    print("  step", {k: (float(f"{m[k]:.4g}") if isinstance(m[k], float) else m[k]) for k in shown})
for c in ckpts:
    print("  checkpoint", c)
skipped = out.read_text(errors="replace").count("all advantages zero, skipping training step")
if skipped:
    # rl_loop trains only on groups whose rewards differ; SmolLM2-135M almost never writes a correct
    # \\boxed{} GSM8K answer, so usually every reward is 0 and that step sends no forward_backward.
    print(f"  note: {skipped} RL step(s) skipped forward_backward/optim_step (all rewards in every group equal)")
if problems:
    print("  PROBLEMS: " + "; ".join(problems))
    sys.exit(1)
EOF
}

# run_loop NAME MODULE MIN_STEPS ARGS...
run_loop() {
    local name="$1" module="$2" steps="$3"; shift 3
    local out="$LOG_DIR/$name.out"
    rm -rf "${LOG_DIR:?}/$name" "$out"
    log "$name: python -m $module $*"
    log "$name: output in $out"
    local start=$SECONDS rc=0
    timeout --signal=INT --kill-after=30 "$LOOP_TIMEOUT" \
        "$py" -m "$module" "$@" >"$out" 2>&1 || rc=$?
    log "$name: exit $rc after $((SECONDS - start)) s"
    if ((rc != 0)); then
        log "$name: last lines of $out:"
        tail -n 40 "$out" >&2
        return "$rc"
    fi
    check_outputs "$LOG_DIR/$name" "$out" "$steps" >&2 || { log "$name: outputs incomplete"; return 1; }
}

# The tinker SDK retries a refused connection for as long as LOOP_TIMEOUT allows, so check first that
# something listens at BASE_URL (waiting up to SERVER_WAIT seconds for a server still starting).
"$py" - "$BASE_URL" "${SERVER_WAIT:-30}" <<'EOF' || die "nothing listens at $BASE_URL (start the server first)"
import socket, sys, time, urllib.parse
u = urllib.parse.urlsplit(sys.argv[1])
host, port = u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80)
deadline = time.monotonic() + float(sys.argv[2])
while True:
    try:
        socket.create_connection((host, port), timeout=3).close()
        break
    except OSError as e:
        if time.monotonic() > deadline:
            print(f"[run_cookbook] cannot connect to {host}:{port}: {e}", file=sys.stderr)
            sys.exit(1)
        time.sleep(1)
EOF

wanted() {  # is program $1 selected by ONLY (default: all)?
    local only=" ${ONLY:-rl_loop sl_loop dpo distill math_rl} "
    only="${only// rl / rl_loop }"; only="${only// sl / sl_loop }"
    [[ "$only" == *" $1 "* ]]
}

# The sampler checkpoint sl_loop saved last in this run, for distill's teacher.
final_sampler_path() {
    "$py" -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print([r for r in rows if r.get("name") == "final"][-1]["sampler_path"])' "$1" 2>/dev/null
}

status=0
failed=()
wanted rl_loop && { run_loop rl_loop tinker_cookbook.recipes.rl_loop "$STEPS" "${rl_args[@]}" || failed+=(rl_loop); }
wanted sl_loop && { run_loop sl_loop tinker_cookbook.recipes.sl_loop "$STEPS" "${sl_args[@]}" || failed+=(sl_loop); }
wanted dpo && { run_loop dpo tinker_cookbook.recipes.preference.dpo.train "$STEPS" "${dpo_args[@]}" || failed+=(dpo); }
if wanted distill; then
    teacher="${TEACHER_CHECKPOINT:-$(final_sampler_path "$LOG_DIR/sl_loop/checkpoints.jsonl")}"
    if [[ -z "$teacher" ]]; then
        log "distill: no teacher checkpoint (run sl_loop first, or set TEACHER_CHECKPOINT)"
        failed+=(distill)
    else
        run_loop distill tinker_cookbook.recipes.distillation.on_policy_distillation "$STEPS" \
            "teacher_checkpoint=$teacher" "${distill_args[@]}" || failed+=(distill)
    fi
fi
wanted math_rl && { run_loop math_rl tinker_cookbook.recipes.math_rl.train "$MATH_RL_STEPS" "${math_rl_args[@]}" || failed+=(math_rl); }
((${#failed[@]})) && status=1
if ((status == 0)); then log "done: every program finished (logs in $LOG_DIR)"; else log "FAILED: ${failed[*]} (logs in $LOG_DIR)"; fi
exit "$status"
