#!/bin/bash
# the call behind call.txt: the CPU a streamed token costs `ember serve`'s threads, before (bbf75df in
# .base, uvicorn on h11) and after (this tree, httptools), alternating in one call
export PYTHONUNBUFFERED=1
J=$OUT; M=$PWD/.serve-model; OLD=$PWD/.base; NEW=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
cp -r /tmp/site /tmp/site-h11; rm -rf /tmp/site-h11/httptools*
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader; nproc
cpu() {  # PID: "tid seconds" of each thread
  python3 -c "
import os, sys
pid = sys.argv[1]; tk = os.sysconf('SC_CLK_TCK')
for t in os.listdir(f'/proc/{pid}/task'):
    f = open(f'/proc/{pid}/task/{t}/stat').read().rsplit(')', 1)[1].split()
    print(t, (int(f[11]) + int(f[12])) / tk)" $1
}
served() {  # NAME SITE TREE
  local name=$1 port=8123 t0=$SECONDS
  (cd $3 && PYTHONPATH=$2:$3 exec python3 -m ember.server.cli serve $M --port $port --load-format dummy --dtype bfloat16 --seed 0 \
    --max-model-len 2048 --uvicorn-log-level warning >"$J/$name.server.log" 2>&1) &
  local pid=$!
  until PYTHONPATH=$2 python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" 2>/dev/null; do
    sleep 1; kill -0 $pid 2>/dev/null || { tail -20 "$J/$name.server.log"; return 1; }; done
  (cd $3 && PYTHONPATH=$2:$3 python3 -c "import ember, importlib.util as u; print('$name', ember.__file__, 'httptools', u.find_spec('httptools') is not None)")
  cpu $pid > /tmp/before
  PYTHONPATH=/tmp/site:$NEW timeout 120 python3 -m ember.server.cli bench serve --base-url http://127.0.0.1:$port --tokenizer $M \
    --dataset random --num-prompts 256 --random-input-len 512 --random-output-len 256 --ignore-eos --seed 0 \
    --output-json "$J/$name.json" 2>&1 | grep -E "Output token throughput|Mean TPOT"
  cpu $pid > /tmp/after
  python3 -c "
b = dict(l.split() for l in open('/tmp/before')); a = dict(l.split() for l in open('/tmp/after'))
d = sorted(((float(v) - float(b.get(t, 0)), t) for t, v in a.items()), reverse=True)
main = float(a['$pid']) - float(b['$pid']); other = [x for x in d if x[1] != '$pid']
print('$name main thread %.2f s = %.1f us/chunk; busiest other thread %.2f s = %.1f us/token; next %s' % (
    main, main / 65536 * 1e6, other[0][0], other[0][0] / 65536 * 1e6, [round(x[0], 2) for x in other[1:4]]))"
  kill -TERM $pid; wait $pid 2>/dev/null; echo "== $name took $((SECONDS - t0)) s"
}
for r in 1 2 3; do served old_$r /tmp/site-h11 $OLD; served new_$r /tmp/site $NEW; done
