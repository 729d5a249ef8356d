"""End-to-end flows on top of the library (the library never imports this package).

* :mod:`.calibrate` — config → model + data → selection → calibration → surgery → artefacts;
* :mod:`.evaluate` — load a model, score it, write ``eval_results.{json,md}``;
* :mod:`.train` — recovery fine-tuning of a corrected model (LoRA / partial / LRAs);
* :mod:`.gguf` — a stock (adapter-free) folder to GGUF with llama.cpp's converter
  (``python -m shift_lightning.recipes.gguf``; :mod:`shift_lightning.export.gguf`);
* :mod:`.cli` — the command-line parsers and the error handling the three entry points
  (``calibrate.py``, ``evaluate.py``, ``train.py``) share;
* :mod:`.trainer` — the ``--trainer.*`` knobs (:class:`~.trainer.TrainerConfig`), checked in one place.
"""
