#!/usr/bin/env bash
# First update through a slot against warm ones, over HTTP, and both against `wsync bench` in the
# same run (docs/benchmark.md, "First update through a slot"). A standalone consumer is driven
# with curl as http_vllm_contract.sh does; wsync_shm_feeder publishes into a ring of FRESH slots,
# so the first FRESH updates land in slots the consumer has never mapped and the WARM ones after
# them in slots it has mapped (each row says which, from the slot name in the manifest).
#
#   http_first_update.sh WSYNC FEEDER [LAYOUT] [FRESH] [WARM] [BENCH_REPEAT]
#
# Prints one JSON row per update ("slot": "fresh" | "warm"; finish_s as curl saw it, import_s /
# verify_s / install_s from the consumer's /metrics), then a result row with medians and the
# ratios first/warm (finish) and warm-over-HTTP/bench (finish over the bench's import + verify +
# install). It times, it does not judge: it fails only when something is refused or left behind
# (BENCH_REPEAT 0 skips the bench). A slot is created at its first publish, before the timed
# finish; what that costs the publisher is not in these rows.
wsync="$1"
feeder="$2"
layout="${3:-qwen2.5-0.5b}"
fresh="${4:-4}"
warm="${5:-6}"
bench_repeat="${6:-5}"
name=http_first_update
source "$(dirname "$0")/processes.sh"

# The feeder answers one line per request, through two FIFOs held open for the whole run.
mkfifo "$work/feed.in" "$work/feed.out"
"$feeder" "$layout" "$fresh" <"$work/feed.in" >"$work/feed.out" 2>"$work/feeder.log" &
feeder_pid=$!
pids+=("$feeder_pid")
exec 3>"$work/feed.in" 4<"$work/feed.out"
ask() { echo "$1" >&3 && read -r -t 600 answer <&4 && echo "$answer"; }

# Not holding the feeder's pipes, which must see EOF when this script closes them.
WSYNC_SERVER_DEV_MODE=1 "$wsync" consumer --standalone --http-port 0 \
  --http-port-file "$work/port" >"$work/consumer.log" 2>&1 3>&- 4<&- &
pids+=("$!")
wait_for_file "$work/port" || fail "consumer did not start"
base="http://127.0.0.1:$(cat "$work/port")"
post() { curl -s -o "$work/reply" -w '%{http_code}' -X POST "$base$1" "${@:2}"; }
stage_sum() {  # the consumer's running total of one stage, seconds
  curl -s "$base/metrics" |
    awk -v s="wsync_update_stage_seconds_sum{stage=\"$1\"}" '$1 == s { print $2 }'
}

[ "$(post /init_weight_transfer_engine -d '{"init_info":{}}')" = 200 ] || fail "init: $(cat "$work/reply")"
declare -A before mapped
for s in import verify install; do before[$s]=0; done
rows=()
held=1  # the oldest version the feeder still holds
for v in $(seq 1 $((fresh + warm))); do
  manifest=$(ask "publish $v")
  [ "${manifest:0:1}" = "{" ] || fail "publish $v: $manifest"
  # Which slot (shared-memory object) it is in: fresh when the consumer has not mapped it yet.
  slot=$(grep -o '"transport_handle":"[^"]*"' <<<"$manifest" | cut -d'"' -f4 | base64 -d |
    grep -o '"name":"[^"]*"')
  [ -n "$slot" ] || fail "publish $v: no slot name in the handle"
  kind=warm
  [ -z "${mapped[$slot]:-}" ] && kind=fresh
  mapped[$slot]=1
  printf '{"update_info":{"manifest":%s}}' "$manifest" >"$work/body.json"
  [ "$(post /start_weight_update)" = 200 ] || fail "start $v: $(cat "$work/reply")"
  [ "$(post /update_weights -H 'Content-Type: application/json' --data-binary @"$work/body.json")" = 200 ] ||
    fail "update $v: $(cat "$work/reply")"
  finish=$(curl -s -o "$work/reply" -w '%{http_code} %{time_total}' -X POST "$base/finish_weight_update")
  [ "${finish%% *}" = 200 ] || fail "finish $v: $(cat "$work/reply")"
  row="{\"event\":\"sample\",\"weight_version\":$v,\"slot\":\"$kind\",\"finish_s\":${finish#* }"
  for s in import verify install; do
    now=$(stage_sum $s)
    row+=",\"${s}_s\":$(awk -v a="$now" -v b="${before[$s]}" 'BEGIN { printf "%.6f", a - b }')"
    before[$s]=$now
  done
  rows+=("$row}")
  echo "$row}"
  # The consumer released v-1 when v became active. The publisher takes a free slot before it
  # makes a new one, so it keeps the first versions until every fresh slot exists.
  if [ "$v" -ge "$fresh" ]; then
    for ((; held < v; held++)); do
      [ "$(ask "release $held")" = "released $held" ] || fail "release $held"
    done
  fi
done

bench_json=null
if [ "$bench_repeat" -gt 0 ]; then
  if [[ "$layout" == synthetic:* ]]; then
    IFS=: read -r _ bytes tensors <<<"$layout"
    what=(--bytes "$bytes" --tensors "$tensors")
  else
    what=(--layout "$layout")
  fi
  "$wsync" bench --mode shared-memory "${what[@]}" --repeat "$bench_repeat" \
    >"$work/bench.jsonl" 2>"$work/bench.log" 3>&- 4<&- || fail "bench failed: $(tail -n 1 "$work/bench.jsonl")"
  bench_json=$(tail -n 1 "$work/bench.jsonl")
fi

printf '%s\n' "${rows[@]}" | python3 -c '
import json, statistics, sys
rows = [json.loads(l) for l in sys.stdin]
bench = json.loads(sys.argv[1])
def med(slot, key):
    v = [r[key] for r in rows if r["slot"] == slot]
    return statistics.median(v) if v else None
out = {"event": "result", "layout": sys.argv[2]}
for slot in ("fresh", "warm"):
    out[slot] = {k: med(slot, k + "_s") for k in ("finish", "import", "verify", "install")}
    out[slot]["data_s"] = sum(out[slot][k] or 0 for k in ("import", "verify", "install"))
if out["warm"]["finish"]:
    out["first_over_warm"] = out["fresh"]["finish"] / out["warm"]["finish"]
if bench:
    t = bench["timings_s"]
    out["bench"] = {"import": t["import"], "verify": t["verify"], "install": t["install"],
                    "data_s": t["import"] + t["verify"] + t["install"]}
    if out["warm"]["finish"]:
        out["warm_http_over_bench"] = out["warm"]["finish"] / out["bench"]["data_s"]
print(json.dumps(out))
' "$bench_json" "$layout"

exec 3>&-  # end of input: the feeder releases its versions, removes its slots and exits
wait "$feeder_pid" || fail "the feeder failed"
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
wait 2>/dev/null
pids=()
check_no_segments
