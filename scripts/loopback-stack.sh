# shellcheck shell=bash
# Sourced by the scripts that start the services by hand on loopback (check-cuda-build.sh,
# cuda-agreement.sh): a free port, waiting for a URL, and a decode
# node, prefill node or router started with its ports picked. Each start appends its
# process to PIDS (the caller kills them on exit) and logs to the file it is given.
# (Not in a command substitution: that would wait for the services they start.)

# A free loopback port.
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Waits (up to a minute) until URL answers.
wait_http() {
    python3 - "$1" <<'PY'
import sys, time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2)
        sys.exit(0)
    except Exception:
        time.sleep(0.2)
sys.exit(sys.argv[1] + " never answered")
PY
}

# start_decode LOG COMMAND...: a decode node (COMMAND: its binary and arguments, the ports
# added); sets DECODE to its gRPC address.
start_decode() {
    local log="$1" d h v
    shift
    d=$(free_port); h=$(free_port); v=$(free_port)
    "$@" --listen "127.0.0.1:$d" --handoff-listen "127.0.0.1:$h" \
        --v1-listen "127.0.0.1:$v" 2>"$log" &
    PIDS+=($!)
    DECODE="127.0.0.1:$d"
}

# start_prefill LOG COMMAND...: a prefill node; sets PREFILL to its gRPC address.
start_prefill() {
    local log="$1" p m
    shift
    p=$(free_port); m=$(free_port)
    "$@" --listen "127.0.0.1:$p" --metrics-listen "127.0.0.1:$m" 2>"$log" &
    PIDS+=($!)
    PREFILL="127.0.0.1:$p"
}

# start_router LOG COMMAND...: a router over $PREFILL and $DECODE, waited for; sets ROUTER
# to its base URL.
start_router() {
    local log="$1" r
    shift
    r=$(free_port)
    "$@" --listen "127.0.0.1:$r" --prefill-url "http://$PREFILL" \
        --decode-url "http://$DECODE" 2>"$log" &
    PIDS+=($!)
    ROUTER="http://127.0.0.1:$r"
    wait_http "$ROUTER/health"
}
