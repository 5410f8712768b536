import sys

from .cli import main

if __name__ == "__main__":  # a spawned child process (the streaming loader's) imports this module too
    sys.exit(main())
