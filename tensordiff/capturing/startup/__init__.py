"""The folder ``tensordiff capture`` puts first on the PYTHONPATH of the program it runs: its ``sitecustomize``
quiets the frameworks' own start-up chatter (MindFormers' INFO lines on stdout, the notices that Transformer Engine or
Apex are not installed) and then runs any other ``sitecustomize`` as it would have run. ``tensordiff capture
--framework-logs`` (or ``TENSORDIFF_FRAMEWORK_LOGS=1``) leaves it out."""

import os

FOLDER = os.path.dirname(os.path.abspath(__file__))
ENV_FRAMEWORK_LOGS = "TENSORDIFF_FRAMEWORK_LOGS"
