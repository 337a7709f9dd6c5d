# SPDX-License-Identifier: Apache-2.0
# nats-lib.sh: what run-nats.sh, run-nats-fleet.sh and run-nats-direct.sh share (sourced, not run):
# the machine's name, free loopback ports and nats-server nodes (one, or a cluster of several on loopback: R3 wants 3) with
# scratch stores under a directory.
# machine_name: the GPU's name and count ("NVIDIA H200 x1"), else the host's name
machine_name() {
  local gpus
  gpus=$(timeout 10 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null) || gpus=
  if [ -n "$gpus" ]; then echo "$(head -1 <<<"$gpus") x$(wc -l <<<"$gpus")"; else hostname; fi
}
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
# nats_start DIR NODES: starts NODES nats-servers (max_payload 8MB, JetStream stores in DIR);
# sets nats_urls (comma-separated) and nats_pids (node i's process), and waits until each says
# it is ready. NATS_PIN="CORES0 CORES1 ...": node i runs on CORES<i> (taskset). NATS_USERS=FILE
# (contrib/nats/users.conf): every node includes a copy of it, so clients need its users.
nats_start() {
  local d=$1 nodes=$2 i j routes cports=() ports=() pins
  read -r -a pins <<<"${NATS_PIN:-}"
  nats_pids=()
  for ((i = 0; i < nodes; i++)); do ports+=("$(free_port)"); cports+=("$(free_port)"); done
  nats_urls=
  if [ -n "${NATS_USERS:-}" ]; then cp "$NATS_USERS" "$d/users.conf"; fi
  for ((i = 0; i < nodes; i++)); do
    {
      printf 'server_name: n%d\nlisten: 127.0.0.1:%s\nmax_payload: 8MB\n' "$i" "${ports[i]}"
      printf 'jetstream { store_dir: "%s/js%d"\n  max_file_store: 64GB }\n' "$d" "$i"
      if ((nodes > 1)); then
        routes=
        for ((j = 0; j < nodes; j++)); do
          if ((j != i)); then routes+="${routes:+, }\"nats-route://127.0.0.1:${cports[j]}\""; fi
        done
        printf 'cluster { name: tallybench\n  listen: 127.0.0.1:%s\n  routes: [%s] }\n' \
          "${cports[i]}" "$routes"
      fi
      if [ -n "${NATS_USERS:-}" ]; then printf 'include "users.conf"\n'; fi
    } >"$d/nats$i.conf"
    if [ -n "${pins[i]:-}" ]; then
      taskset -c "${pins[i]}" nats-server -c "$d/nats$i.conf" >"$d/nats$i.log" 2>&1 &
    else
      nats-server -c "$d/nats$i.conf" >"$d/nats$i.log" 2>&1 &
    fi
    nats_pids+=($!)
    nats_urls+="${nats_urls:+,}nats://127.0.0.1:${ports[i]}"
  done
  for ((i = 0; i < nodes; i++)); do
    for _ in $(seq 200); do grep -q "Server is ready" "$d/nats$i.log" && break; sleep 0.1; done
    grep -q "Server is ready" "$d/nats$i.log" || { echo "nats-server $i not ready ($d)" >&2; return 1; }
  done
}
