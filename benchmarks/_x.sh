python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/core_runner/spec_decode/test_overlap_gpu.py 2>&1 | grep -v "^  warn\|Warning" | tail -40
