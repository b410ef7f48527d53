"""Print the folder to pass as MindFormers' ``--register_path`` (or ``REGISTER_PATH``)."""
import os

print(os.path.dirname(os.path.abspath(__file__)))
