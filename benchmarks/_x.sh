python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 benchmarks/spec_decode.py --qwen3-shape --device cuda --max-tokens 128 --batch-sizes 1 --phases 2>&1 | grep -v "^\s*[0-9]* *[0-9.]* *[0-9.]* *[0-9.]* *[0-9.]* /\|Writing\|ncalls\|Ordered\|List reduced\|function calls\|warn"
