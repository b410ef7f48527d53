"""Print the folder to pass as MindFormers' ``--register_path`` (or ``REGISTER_PATH``)."""
from . import REGISTER_DIR

print(REGISTER_DIR)
