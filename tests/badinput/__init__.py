"""The bad-input tier: every bad input a user met, as data, run through ``cooper`` in this process.

Each case (:class:`tests.badinput.case.Case`) names what the user ran and what they must get: the exit
code (2 unless documented otherwise), one ERROR line naming the setting, flag or file, no traceback,
nothing lost or left behind, and, where there is one, the fix then working. One checker runs them all
(:func:`tests.badinput.case.check_case`, from ``test_badinput.py``). ``python tests/tiers.py badinput``
runs the tier; ``make test`` runs it after ``unit``.

The cases, by module:

* ``checkpoints.py``: a flipped byte in a shard (``convert``, ``eval``, ``eval-rm``, ``train``, ``sft``,
  ``train-rm``, whose retry with a good ``--ckpt`` on the same ``--out`` then works), an unfinished
  ``step_<n>.tmp`` (``convert``; ``eval`` of one killed before its ``cooper_model.json``), an HF export
  without a tokenizer or with one that does not fit, a garbage ``common.pt``, the converter's inputs;
* ``run_folders.py``: a folder another run holds (``train``, ``sft``, ``train-rm``), a resume that
  changes ``reward.mode`` or ``model.init``, ``--resume none`` on a folder that holds a run, a read-only
  folder, a dangling symlink whose target cannot be made;
* ``settings.py``: ``algo.tis_cap`` that float32 makes 0 or infinite, an integer past 64 bits,
  ``rollout.engine=sglang`` without SGLang, ``cooper plan`` with ``parallel.ep=2`` on a dense model
  (the trainer's message; the same run then plans at ep=1), ``cooper rehearse`` with
  ``rollout.sglang_base_port=70000``, demo seeds past every generator's, NaN, inf and out-of-range
  numbers on the command line, several problems at once, presets that are not YAML mappings of
  sections, the config library's errors, unknown settings looked up;
* ``training.py``: data whose every reference the rule cannot read (warned at start, stopped after
  ``train.max_steps_without_signal`` steps, checkpoint kept), an assistant endpoint that does not answer;
* ``files.py``: ``verify`` into a folder, a FIFO, a link to a device or a path through a file; an input
  without rows or with a malformed one; ``tiny-assets`` into a file; ``plot`` of metrics of no run.

Covered elsewhere, because they need real processes, a fault injected into a running job, or a
component the CLI cannot reach with a bad input alone (the suite's inventory is here):

* two runs on one ``--out`` (real ``cooper train`` processes), and every rank of a torchrun job refused
  with the holder's line: ``tests/multiproc/test_reliability_runs.py``
  (``test_a_run_folder_belongs_to_one_run_and_a_resume_is_the_run_it_resumes``,
  ``test_every_rank_of_a_refused_torchrun_job_stops_with_the_holders_line``), which also holds a
  checkpoint that cannot be written (exit 74), Ctrl-C once and twice (75, 130), prompts too long for
  the policy, a collective that a rank never joins, and a conversion whose output cannot be written;
* SIGKILL, SIGTERM (75), a corrupt newest checkpoint on resume, NaN losses (exit 3):
  ``tests/multiproc/test_faults.py``;
* the first-step guard when the rollout engine is not the policy (its message's nats):
  ``tests/unit/test_engine_check.py``;
* a full disk (ENOSPC, simulated) and the CLI's classification of errors: ``tests/unit/test_cli_errors.py``;
  the converter's truncated shards and full disks: ``tests/unit/test_convert_bad_files.py``;
* malformed dataset rows and files (hypothesis): ``tests/unit/test_properties_readers.py``;
* ``cooper annotate`` without rows or a readable judge, outputs that are not regular files for every
  writer: ``tests/unit/test_reliability.py``; an unreachable assistant during training:
  ``tests/unit/test_failing_services.py``;
* what are no longer errors: a symlinked ``--out`` whose target is missing gets it created
  (``tests/unit/test_settings_checks.py``), ``cooper config KEY`` looks the key up
  (``tests/unit/test_config_lookup.py``), offline wandb says one line (``tests/unit/test_metrics.py``).
"""
