#!/usr/bin/env bash
# Summarise against eviction with every layer on an RPC server on the same machine (2026-11-27, 22nd session, Intel
# Xeon 2 cores): kvbench --rpc, flash attention on and off. "old" runs the same kvbench on the libraries installed
# before the session's change (summarise's device reads in one gather), "new" on the build folder's.
# Usage: bash docs/results/rpc/run.sh OLD_LIB_DIR NEW_LIB_DIR OUT_DIR
set -u
OLD=$1; NEW=$2; OUT=$3
B=build/cp311-cp311-linux_x86_64; K=$B/kvbench
M=$(python -c "from pykvcache import default_model_path; print(default_model_path())")
F=$(python -c "from pykvcache import corpus; print(corpus.essays_file())")
P=$(python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
python -m pykvcache.rpc --port $P -t 2 > /dev/null 2>&1 & SERVER=$!
trap 'kill $SERVER' EXIT
sleep 3
A="-m $M -f $F --rpc 127.0.0.1:$P -ngl 99 -p 2048 -t 2 -o json --no-progress --policy snapkv:budget=0.1 --policy snapkv:budget=0.1+summarise"
L="-n 256 -r 2 --policy snapkv:budget=0.1+summarise:lam=0"
LD_LIBRARY_PATH=$NEW $K $A $L -fa on  > $OUT/kvbench-summarise-new_fa.json
LD_LIBRARY_PATH=$OLD $K $A $L -fa on  > $OUT/kvbench-summarise-old_fa.json
LD_LIBRARY_PATH=$NEW $K $A $L -fa off > $OUT/kvbench-summarise-new_nofa.json
S="-n 32 -r 1 --no-limit -fa off"    # before the change, summarise decoded at ~5 t/s here: a short run
LD_LIBRARY_PATH=$OLD $K $A $S > $OUT/kvbench-summarise-old_nofa_short.json
LD_LIBRARY_PATH=$NEW $K $A $S > $OUT/kvbench-summarise-new_nofa_short.json
