"""end_process: a process ends with its code, its logs and stdio flushed, and no interpreter teardown."""

import subprocess
import sys

CHILD = """
import atexit, logging, sys
from slidedp.lifetime import end_process
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
atexit.register(lambda: print("teardown ran", flush=True))
sys.stdout.write("the last words, unflushed")  # a pipe: block-buffered, lost by a bare os._exit
logging.getLogger("child").info("logged before the end")
end_process(3)
print("after the end")
"""


def test_end_process_flushes_and_skips_the_teardown():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert proc.stdout == "the last words, unflushed"  # flushed; neither atexit nor the next line ran
    assert proc.stderr == "logged before the end\n"
