"""Untrusted files and secrets.

* Weights load only from safetensors or ``torch.load(weights_only=True)``: the package source is
  scanned (AST) for unsafe loads, and HF model loads must ask for safetensors.
* ``trust_remote_code`` is off unless asked: every transformers ``from_pretrained`` call passes
  it explicitly, the config default is False, and a tokenizer folder that ships Python code does
  not get it run.
* API keys come from the environment and never reach the saved ``config.yaml`` (the run's record),
  ``metrics.jsonl``, the wandb offline files or the log output, even when one is pasted into a
  config setting by mistake.
"""

from __future__ import annotations

import ast
import json
import logging
import time
from pathlib import Path

import pytest

from cooper_mcore.config.schema import load_config, to_dict
from cooper_mcore.config.versions import ConfigRecord, write_record
from cooper_mcore.redaction import SecretFilter, install_log_filter, looks_secret, scrub, secret_values

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for d in ("cooper_mcore", "tools", "benchmarks") for p in (ROOT / d).rglob("*.py"))
SECRET = "sk-test-9f8e7d6c5b4a39281706"


def _calls(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def _kw(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def test_sources_found():
    assert len(SOURCES) > 40 and any(p.parent.name == "checkpoint" and p.name == "training.py" for p in SOURCES)


def test_no_unsafe_deserialization_in_the_package():
    problems = []
    for path in SOURCES:
        for call, func in _calls(path):
            where = f"{path.relative_to(ROOT)}:{call.lineno}: {func}"
            if func == "torch.load" or func.endswith(".torch.load"):
                value = _kw(call, "weights_only")
                if not (isinstance(value, ast.Constant) and value.value is True):
                    problems.append(f"{where} without weights_only=True")
            if func in ("pickle.load", "pickle.loads", "marshal.load", "marshal.loads", "dill.load", "dill.loads",
                        "cloudpickle.load", "cloudpickle.loads", "joblib.load"):
                problems.append(f"{where} unpickles")
            if func.endswith(("np.load", "numpy.load")):
                value = _kw(call, "allow_pickle")
                if isinstance(value, ast.Constant) and value.value is True:
                    problems.append(f"{where} with allow_pickle=True")
    assert problems == []


def test_every_transformers_load_is_explicit_about_remote_code_and_safetensors():
    problems, seen = [], 0
    for path in SOURCES:
        for call, func in _calls(path):
            if not func.endswith(".from_pretrained") or func.startswith(("cls.", "HFEngine.")):
                continue  # our own HFEngine.from_pretrained threads the flag itself (checked below)
            seen += 1
            where = f"{path.relative_to(ROOT)}:{call.lineno}: {func}"
            if _kw(call, "trust_remote_code") is None:
                problems.append(f"{where} does not pass trust_remote_code")
            is_model = "Model" in func or func == "auto.from_pretrained"
            value = _kw(call, "use_safetensors")
            if is_model and not (isinstance(value, ast.Constant) and value.value is True):
                problems.append(f"{where} loads weights without use_safetensors=True")
    assert seen >= 5 and problems == []


def test_trust_remote_code_defaults_off():
    from cooper_mcore.rollout.sglang_engine import SGLangConfig

    assert load_config().model.trust_remote_code is False
    assert SGLangConfig(model_path="/m").trust_remote_code is False
    assert load_config(None, ["model.trust_remote_code=true"]).model.trust_remote_code is True


def test_a_tokenizer_folder_with_code_does_not_run_it(tmp_path):
    from cooper_mcore.data.tokenizer import load_tokenizer

    folder = tmp_path / "evil_tok"
    folder.mkdir()
    marker = tmp_path / "code_ran"
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                    "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}, "tokenizer_class": "EvilTokenizer"}))
    (folder / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "evil.X"}}))
    with pytest.raises(ValueError, match="contains custom code"):  # transformers refuses without the flag
        load_tokenizer(str(folder))
    assert not marker.exists()  # (with trust_remote_code=True the same folder's evil.py runs)


def test_hf_engine_refuses_pickled_weights(tmp_path):
    import torch

    from cooper_mcore.models.tiny import save_tiny_hf_model
    from cooper_mcore.rollout.hf_engine import HFEngine

    hf_dir = Path(save_tiny_hf_model(str(tmp_path / "m"), "qwen2"))
    (hf_dir / "model.safetensors").unlink()
    torch.save({}, hf_dir / "pytorch_model.bin")  # only a pickle left
    with pytest.raises(Exception, match="safetensors|model.safetensors"):
        HFEngine.from_pretrained(str(hf_dir))


# --------------------------------------------------------------------------- secrets


def test_secret_values_and_scrub(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    monkeypatch.setenv("MY_ASSISTANT_CRED_X", "cred-1234567890")  # named like a secret ("CRED" alone is not)
    monkeypatch.setenv("ASSISTANT_AUTH", "auth-1234567890")  # not secret-looking: only when named explicitly
    monkeypatch.setenv("SHORT_TOKEN", "1")  # too short to hide
    assert looks_secret("HF_TOKEN") and looks_secret("wandb_api_key") and not looks_secret("MAX_NEW_TOKENS_X")
    assert SECRET in secret_values() and "auth-1234567890" not in secret_values()
    assert "auth-1234567890" in secret_values(["ASSISTANT_AUTH"]) and "1" not in secret_values()
    doc = {"url": f"http://h/?key={SECRET}", "list": [SECRET, 3], "n": 1.5}
    assert scrub(doc) == {"url": "http://h/?key=***", "list": ["***", 3], "n": 1.5}


def test_log_lines_and_tracebacks_are_scrubbed(monkeypatch, caplog):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    log = logging.getLogger("cooper_mcore.test_security")
    filt = SecretFilter()
    caplog.handler.addFilter(filt)
    try:
        with caplog.at_level(logging.INFO):
            log.info("calling %s with key %s", "http://x", SECRET)
            try:
                raise RuntimeError(f"server echoed Bearer {SECRET}")
            except RuntimeError:
                log.exception("request failed")
    finally:
        caplog.handler.removeFilter(filt)
    text = caplog.text + "".join(r.exc_text or "" for r in caplog.records)
    assert "calling http://x with key ***" in text and "server echoed Bearer ***" in text
    assert SECRET not in text


def _all_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


def test_key_in_env_and_in_a_config_field_reaches_no_file_or_log(tmp_path, monkeypatch, caplog):
    """The run's files: config.yaml (the run's config record), metrics.jsonl + wandb offline files
    (MetricsLogger), and the log output; the key is in the environment and, by mistake, in
    ``rm.api_key_env`` and a URL."""
    import wandb

    from cooper_mcore.metrics import MetricsLogger

    wandb.teardown()  # wandb keeps its settings (WANDB_DIR) per process: start from a clean state
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    cfg = load_config(None, [f"rm.api_key_env={SECRET}", f"rm.assistant_url=http://host:1/?api_key={SECRET}",
                             "logging.run_name=probe"])
    out = tmp_path / "run"
    write_record(str(out / "config.yaml"), ConfigRecord.start(to_dict(cfg)))
    saved = load_config(str(out / "config.yaml"))  # still a loadable config
    assert saved.rm.api_key_env == "***" and saved.rm.assistant_url == "http://host:1/?api_key=***"
    filt = install_log_filter([cfg.rm.api_key_env])
    caplog.handler.addFilter(filt)
    try:
        with caplog.at_level(logging.INFO):
            with MetricsLogger(str(out), run_name=f"run-{SECRET}", config=to_dict(cfg)) as mlog:
                assert mlog.wandb_mode == "offline"
                mlog.log(1, {"reward/mean": 0.5})
            logging.getLogger("cooper_mcore.test").warning("assistant at %s failed", cfg.rm.assistant_url)
    finally:
        caplog.handler.removeFilter(filt)
        for h in logging.getLogger().handlers:
            h.removeFilter(filt)
        wandb.teardown()
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    deadline = time.monotonic() + 10  # wandb-core may still be flushing after finish()
    while time.monotonic() < deadline and b"reward/mean" not in _all_bytes(runs[0]):
        time.sleep(0.05)
    files = {p.name for p in out.iterdir()}
    assert {"config.yaml", "metrics.jsonl", "wandb"} <= files
    assert b"reward/mean" in b"".join(p.read_bytes() for p in runs[0].glob("*.wandb"))
    assert SECRET.encode() not in _all_bytes(out)
    assert "assistant at http://host:1/?api_key=*** failed" in caplog.text and SECRET not in caplog.text
