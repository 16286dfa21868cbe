#!/usr/bin/env bash
# Drives a standalone wsync consumer with curl, using only vLLM's documented weight-transfer
# contract (paths, query parameters, JSON bodies, bare POSTs): pause -> init -> start -> update
# -> finish -> resume, then every bad request the contract names. The only wsync-specific part
# is the backend info inside update_info: the manifest a standalone publisher wrote.
wsync="$1"
name=http_vllm_contract
source "$(dirname "$0")/processes.sh"

# post PATH [JSON] -> "<status> <body>" (a bare POST when no JSON is given, as vLLM's docs do)
post() {
  if [ $# -ge 2 ]; then
    curl -s -X POST "$base$1" -H 'Content-Type: application/json' -d "$2" -w ' %{http_code}' -H "$auth"
  else
    curl -s -X POST "$base$1" -w ' %{http_code}' -H "$auth"
  fi
}
get() { curl -s "$base$1" -w ' %{http_code}' -H "$auth"; }
expect() {  # what, "<reply>", status, text the body must contain
  local code="${2##* }"
  [ "$code" = "$3" ] || fail "$1: HTTP $code, expected $3: $2"
  grep -q -- "$4" <<<"$2" || fail "$1: body lacks '$4': $2"
}

"$wsync" publisher --standalone --rank 0 --layout synthetic:2097152:6 --versions 3 \
  --manifest-out "$work/manifests.jsonl" >"$work/publisher.log" 2>&1 &
pids+=("$!")
WSYNC_SERVER_DEV_MODE=1 "$wsync" consumer --standalone --http-port 0 \
  --http-port-file "$work/port" --world-size 2 --data-parallel 2 >"$work/consumer.log" 2>&1 &
consumer=$!
pids+=("$consumer")
for _ in $(seq 200); do [ -s "$work/port" ] && [ -s "$work/manifests.jsonl" ] && break; sleep 0.05; done
[ -s "$work/port" ] || fail "consumer did not start"
[ -s "$work/manifests.jsonl" ] || fail "publisher did not write manifests"
base="http://127.0.0.1:$(cat "$work/port")"
auth="X-Nothing: 1"
m1=$(sed -n 1p "$work/manifests.jsonl")
m2=$(sed -n 2p "$work/manifests.jsonl")
m3=$(sed -n 3p "$work/manifests.jsonl")
names=$(grep -o '"name":"[^"]*"' <<<"$m1" | head -2 | sed 's/"name"://' | paste -sd,)

# The lifecycle, as rlhf_http_nccl.py runs it.
expect world_size "$(get /get_world_size)" 200 '"world_size":4'
expect world_size_tp "$(get '/get_world_size?include_dp=false')" 200 '"world_size":2'
expect pause "$(post /pause)" 200 '"status":"paused"'
expect is_paused "$(get /is_paused)" 200 '"is_paused":true'
expect init "$(post /init_weight_transfer_engine '{"init_info":{}}')" 200 'Weight transfer initialized'
expect start "$(post /start_weight_update '{"is_checkpoint_format": true}')" 200 'Weight update started'
expect update_chunk1 "$(post /update_weights "{\"update_info\":{\"names\":[$names],\"manifest\":$m1}}")" 200 'Weights updated'
expect update_chunk2 "$(post /update_weights "{\"update_info\":{\"names\":[$names]}}")" 200 'Weights updated'
expect status_before_finish "$(get /status)" 200 '"active_weight_version":0'
expect finish "$(post /finish_weight_update '{}')" 200 'Weight update finished'
expect resume "$(post /resume)" 200 '"status":"resumed"'
expect is_paused_after "$(get /is_paused)" 200 '"is_paused":false'
expect status "$(get /status)" 200 '"active_weight_version":1'
expect weight_info "$(get /weight_info)" 200 '"weight_version":"1"'
expect weight_version "$(post /update_weight_version '{"new_version":"step-1"}')" 200 '"weight_version":"step-1"'
expect weight_info_label "$(get /weight_info)" 200 '"weight_version":"step-1"'
expect sglang_routes_off "$(post /pause_generation '{}')" 404 'path: no route /pause_generation'
echo "http_vllm_contract: pause -> init -> start -> update -> finish -> resume: version 1 active"

# Newer clients: bare start and finish, update_info as a list.
expect start_bare "$(post /start_weight_update)" 200 'Weight update started'
expect update_list "$(post /update_weights "{\"update_info\":[{\"manifest\":$m2}]}")" 200 'Weights updated'
expect finish_bare "$(post /finish_weight_update)" 200 '"weight_version":2'

# Out of order: 409 naming the current phase.
expect finish_without_start "$(post /finish_weight_update)" 409 "'ready'"
expect update_without_start "$(post /update_weights "{\"update_info\":{\"manifest\":$m3}}")" 409 "'ready'"
expect start "$(post /start_weight_update)" 200 'started'
expect start_twice "$(post /start_weight_update)" 409 "'started'"
expect finish_without_update "$(post /finish_weight_update)" 409 'no /update_weights'
expect start_after_empty_finish "$(post /start_weight_update)" 200 'started'

# Malformed or missing fields: 400 naming the field.
expect bad_json "$(post /update_weights '{"update_info":')" 400 'invalid JSON'
expect missing_update_info "$(post /update_weights '{}')" 400 'update_info: missing'
expect update_info_not_object "$(post /update_weights '{"update_info":1}')" 400 'update_info: must be'
expect init_info_list "$(post /init_weight_transfer_engine '{"init_info":[]}')" 400 'init_info: must be'
expect missing_init_info "$(post /init_weight_transfer_engine '{}')" 400 'init_info: missing'
expect bad_checkpoint_flag "$(post /start_weight_update '{"is_checkpoint_format":"yes"}')" 400 'is_checkpoint_format: must be a boolean (rank=0)'
expect unknown_name "$(post /update_weights "{\"update_info\":{\"names\":[\"nope\"],\"manifest\":$m3}}")" 400 'update_info.names\[0\]'
expect length_mismatch "$(post /update_weights "{\"update_info\":{\"names\":[$names],\"shapes\":[[1]],\"manifest\":$m3}}")" 400 'update_info.shapes'
expect old_version "$(post /update_weights "{\"update_info\":{\"manifest\":$m1}}")" 400 'weight_version must increase monotonically'
expect bad_mode "$(post '/pause?mode=sideways')" 400 'mode: .*sideways.* is not one of abort, wait, keep'
expect bad_include_dp "$(get '/get_world_size?include_dp=maybe')" 400 'include_dp'
expect wrong_method "$(get /pause)" 404 'path: no route /pause'
expect status_unchanged "$(get /status)" 200 '"active_weight_version":2'

# A failed install (a checksum that does not match the bytes): 500 with the reason, and the
# previous version stays active.
bad=$(sed 's/"checksum":"[0-9a-f]*"/"checksum":"0000000000000001"/' <<<"$m3")
expect update_corrupt "$(post /update_weights "{\"update_info\":{\"manifest\":$bad}}")" 200 'Weights updated'
expect finish_corrupt "$(post /finish_weight_update)" 500 'tensor checksum mismatch'
expect status_kept "$(get /status)" 200 '"active_weight_version":2'
expect metrics "$(get /metrics)" 200 'wsync_updates_rejected_total 1'
echo "http_vllm_contract: out-of-order, malformed and failed requests refused; version 2 kept"

# A bearer token, when configured, is required on every route.
kill -TERM "$consumer"
WSYNC_SERVER_DEV_MODE=1 "$wsync" consumer --standalone --http-port 0 --http-token s3cret \
  --http-port-file "$work/port2" >"$work/consumer2.log" 2>&1 &
pids+=("$!")
for _ in $(seq 200); do [ -s "$work/port2" ] && break; sleep 0.05; done
base="http://127.0.0.1:$(cat "$work/port2")"
expect no_token "$(get /status)" 401 'bearer token'
auth="Authorization: Bearer wrong"
expect wrong_token "$(post /pause)" 401 'bearer token'
auth="Authorization: Bearer s3cret"
expect right_token "$(get /is_paused)" 200 '"is_paused":false'

# Transport options travel in init_info: a file-mmap directory written by a standalone publisher.
mkdir "$work/fmm"
"$wsync" publisher --standalone --rank 0 --layout synthetic:1048576:4 --versions 1 \
  --transport file-mmap --transport-option "dir=$work/fmm" --manifest-out "$work/fmm.jsonl" \
  >"$work/fmm_publisher.log" 2>&1 || fail "file-mmap publisher failed"
WSYNC_SERVER_DEV_MODE=1 "$wsync" consumer --standalone --http-port 0 \
  --http-port-file "$work/port3" >"$work/consumer3.log" 2>&1 &
pids+=("$!")
wait_for_file "$work/port3" || fail "consumer 3 did not start"
base="http://127.0.0.1:$(cat "$work/port3")"
auth="X-Nothing: 1"
expect fmm_no_dir "$(post /init_weight_transfer_engine '{"init_info":{"transport":"file-mmap"}}')" 400 'dir: required'
expect fmm_bad_options "$(post /init_weight_transfer_engine '{"init_info":{"transport":"file-mmap","transport_options":["dir"]}}')" 400 'init_info.transport_options: must be an object'
expect fmm_init "$(post /init_weight_transfer_engine "{\"init_info\":{\"transport\":\"file-mmap\",\"transport_options\":{\"dir\":\"$work/fmm\"}}}")" 200 'Weight transfer initialized'
expect fmm_other_dir "$(post /init_weight_transfer_engine '{"init_info":{"transport":"file-mmap","transport_options":{"dir":"/elsewhere"}}}')" 400 'options differ'
expect fmm_start "$(post /start_weight_update)" 200 'started'
expect fmm_update "$(post /update_weights "{\"update_info\":{\"manifest\":$(head -1 "$work/fmm.jsonl")}}")" 200 'Weights updated'
expect fmm_finish "$(post /finish_weight_update)" 200 '"weight_version":1'

# Off by default: without --enable-weight-transfer a standalone consumer refuses to start.
env -u WSYNC_SERVER_DEV_MODE "$wsync" consumer --standalone >"$work/off.log" 2>&1 &&
  fail "a standalone consumer started without the HTTP surface enabled"
grep -q "enable-weight-transfer" "$work/off.log" || fail "the refusal does not say how to enable it"

for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
wait 2>/dev/null
pids=()
check_no_segments
echo "http_vllm_contract: pass"
