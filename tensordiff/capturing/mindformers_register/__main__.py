"""Print the folder to pass as MindFormers' ``--register_path`` (or ``REGISTER_PATH``)."""
import sys

from . import REGISTER_DIR

sys.stdout.write(REGISTER_DIR + "\n")
