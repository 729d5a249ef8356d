"""``python -m shift_lightning.lmeval …``: lm-eval's command line with ``--model shift`` registered."""

from . import main

main()
