"""A torchrun worker for tests/test_launch.py: records its pid in argv[1], then sleeps."""

import os
import sys
import time

if __name__ == "__main__":
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)
