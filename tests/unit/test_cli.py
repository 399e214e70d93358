"""The `cooper` command: verify end to end, and named errors."""

import json

from cooper_mcore.cli import main


def test_cooper_verify(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    rows = [{"gold": "1/2", "pred": "thus \\boxed{0.5}"}, {"gold": "72", "pred": "so #### 71"},
            {"gold": "\\{1,2\\}", "pred": "$\\{2,1\\}$"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["verify", "--in", str(src), "--out", str(tmp_path / "out.jsonl"), "--timeout", "5"]) == 0
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["correct"] for o in out] == [True, False, True]
    assert all(o["seconds"] >= 0 for o in out) and out[0]["gold"] == "1/2"
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["total"], summary["correct"], summary["wrong"]) == (3, 2, 1)


def test_cooper_verify_malformed_line(tmp_path, caplog):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"gold": "1", "pred": "1"}\n{"gold": 1\n')
    assert main(["verify", "--in", str(src), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "bad.jsonl" in caplog.text and "2" in caplog.text
    assert not (tmp_path / "o.jsonl").exists()
