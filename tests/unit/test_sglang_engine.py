"""The SGLang engine without a GPU or sglang: server-args and sampling translation, the flattened
weight buckets, output parsing from an SGLang-shaped response, the HTTP contract against a local
fake server, the offline path against a fake ``sglang.Engine``, and errors for a dead server.

Setting ``SGLANG_SRC`` to an unpacked SGLang 0.5.23 tree (``pip download sglang==0.5.23 --no-deps``
and unzip) also checks the pinned names and the bucket format against SGLang's own source.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from cooper_mcore.rollout.base import SamplingParams, bucketize
from cooper_mcore.rollout.sglang_engine import (
    MEMORY_TAGS,
    SAMPLING_PARAM_NAMES,
    SERVER_ARG_NAMES,
    SGLANG_VERSION,
    SGLangConfig,
    SGLangEngine,
    check_server_arg_names,
    parse_generate_output,
    server_cli_args,
    server_command,
    to_sglang_sampling_params,
)
from cooper_mcore.rollout.sglang_http import SGLangHTTPClient
from cooper_mcore.rollout.sglang_payload import (
    LOAD_FORMAT,
    flatten_bucket,
    rank_payload,
    serialize_for_sglang,
    sglang_bucket_payload,
    unflatten_bucket,
)

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
SGLANG_SRC = os.environ.get("SGLANG_SRC")
needs_src = pytest.mark.skipif(not SGLANG_SRC, reason="set SGLANG_SRC to an unpacked sglang 0.5.23 tree")

# The globals SGLang 0.5.23's SafeUnpickler (sglang/srt/utils/common.py) admits that a CPU-tensor
# flattened_bucket payload needs; the real list is checked under SGLANG_SRC.
PINNED_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"), ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"), ("torch.multiprocessing.reductions",
                                                                    "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"), ("torch.storage", "UntypedStorage"),
    ("multiprocessing.resource_sharer", "DupFd"), ("torch", "Tensor"), ("torch", "Size"), ("types", "SimpleNamespace"),
    ("copyreg", "__newobj__"), *[("torch", d) for d in ("uint8", "bfloat16", "float16", "float32", "int64", "bool",
                                                        "int32", "int8")],
}


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 5, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(3, 4, generator=g)),
        ("model.norm.weight", torch.randn(5, generator=g).to(torch.float16)),
        ("counts", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
        ("mask", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(3.5)),
        ("empty", torch.empty(0, 4)),
        ("view", torch.randn(4, 6, generator=g)[:, 1::2]),  # non-contiguous
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class _Recorder(pickle.Unpickler):
    """Unpickles like SGLang's SafeUnpickler: only globals in ``allowed``."""

    def __init__(self, data: bytes, allowed):
        super().__init__(io.BytesIO(data))
        self.allowed, self.seen = allowed, []

    def find_class(self, module, name):
        self.seen.append((module, name))
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"blocked {module}.{name}")
        return super().find_class(module, name)


def _receive(payload_bytes: bytes, allowed=PINNED_ALLOWED, seen=None):
    """What SGLang's flattened_bucket loader does with one rank's payload (attribute access).

    A payload can be received once: shared CPU storages travel as file descriptors."""
    rec = _Recorder(payload_bytes, allowed)
    obj = rec.load()
    if seen is not None:
        seen.extend(rec.seen)
    flat = obj["flattened_tensor"]
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in obj["metadata"]]


# -- import hygiene ----------------------------------------------------------------------------
def test_import_does_not_import_sglang():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'sglang' or name.startswith('sglang.'):\n"
        "            raise AssertionError('imported ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import cooper_mcore.rollout.sglang_engine as m\n"
        "assert not [k for k in sys.modules if k.split('.')[0] == 'sglang']\n"
        "print(m.SGLANG_VERSION)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == SGLANG_VERSION == "0.5.23"


# -- server args -------------------------------------------------------------------------------
def test_server_args_map_the_config():
    cfg = SGLangConfig(model_path="/m", tp_size=2, mem_fraction_static=0.35, dtype="float16",
                       enable_memory_saver=True, random_seed=7, port=31000, context_length=None,
                       extra_server_args={"disable_radix_cache": True})
    args = cfg.server_args()
    assert set(args) - {"disable_radix_cache"} <= SERVER_ARG_NAMES
    assert args["model_path"] == "/m" and args["tp_size"] == 2 and args["mem_fraction_static"] == 0.35
    assert args["dtype"] == "float16" and args["enable_memory_saver"] is True and args["random_seed"] == 7
    assert args["port"] == 31000 and args["disable_radix_cache"] is True
    assert "context_length" not in args and "tokenizer_path" not in args  # None: SGLang's default


@pytest.mark.parametrize("field,value,match", [
    ("mem_fraction_static", 1.2, "mem_fraction_static"), ("tp_size", 0, "tp_size"),
    ("dtype", "fp8", "dtype"), ("model_path", "", "model_path"), ("port", 70000, "port"),
])
def test_config_errors_name_the_field(field, value, match):
    cfg = SGLangConfig(model_path="/m")
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=match):
        cfg.server_args()


def test_extra_args_may_not_shadow_fields_and_names_are_checked():
    with pytest.raises(ValueError, match=r"\['tp_size'\]"):
        SGLangConfig(model_path="/m", extra_server_args={"tp_size": 4}).server_args()
    args = SGLangConfig(model_path="/m", extra_server_args={"bogus_flag": 1}).server_args()
    with pytest.raises(ValueError, match="bogus_flag"):
        check_server_arg_names(args, SERVER_ARG_NAMES)
    check_server_arg_names(SGLangConfig(model_path="/m").server_args(), SERVER_ARG_NAMES)


def test_cli_args():
    argv = server_cli_args({"model_path": "/m", "tp_size": 2, "enable_memory_saver": True,
                            "skip_tokenizer_init": False, "context_length": None, "mem_fraction_static": 0.4})
    assert argv == ["--model-path", "/m", "--tp-size", "2", "--enable-memory-saver", "--mem-fraction-static", "0.4"]
    cmd = server_command(SGLangConfig(model_path="/m"), python="py")
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"] and "--enable-memory-saver" in cmd
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"


# -- sampling ----------------------------------------------------------------------------------
def test_sampling_params_translation():
    p = SamplingParams(max_new_tokens=16, temperature=0.0, top_p=0.9, stop=["\n\n"], seed=5)
    assert to_sglang_sampling_params(p, 0) == {"max_new_tokens": 16, "temperature": 0.0, "top_p": 0.9,
                                               "stop": ["\n\n"], "sampling_seed": 5}
    assert to_sglang_sampling_params(p, 3)["sampling_seed"] == 8  # repeated prompts draw differently
    plain = to_sglang_sampling_params(SamplingParams())
    assert plain == {"max_new_tokens": 512, "temperature": 1.0, "top_p": 1.0}
    assert set(to_sglang_sampling_params(p)) <= SAMPLING_PARAM_NAMES
    with pytest.raises(ValueError, match="top_p"):
        to_sglang_sampling_params(SamplingParams(top_p=0.0))


# -- flattened buckets -------------------------------------------------------------------------
def test_flatten_roundtrip_is_bitwise_and_metadata_exact():
    ts = _tensors()
    flat = flatten_bucket(ts)
    assert flat.flattened_tensor.dtype == torch.uint8 and flat.flattened_tensor.dim() == 1
    end = 0
    for (name, t), m in zip(ts, flat.metadata):
        size = t.numel() * t.element_size()
        assert (m.name, tuple(m.shape), m.dtype) == (name, tuple(t.shape), t.dtype)
        assert m.start_idx % t.element_size() == 0  # the receiver views the slice as the dtype
        assert 0 <= m.start_idx - end < t.element_size()  # only the padding alignment needs
        assert (m.end_idx, m.numel) == (m.start_idx + size, size)
        end = m.end_idx
    assert flat.flattened_tensor.numel() == end
    # 7*5 bf16 = 70 bytes, so the fp32 tensor after it is padded to 72
    assert [m.start_idx for m in flat.metadata[:2]] == [0, 72]
    back = unflatten_bucket(flat)
    assert [n for n, _ in back] == [n for n, _ in ts]
    for (_, t), (_, b) in zip(ts, back):
        assert b.dtype == t.dtype and b.shape == t.shape
        assert torch.equal(_bits(b), _bits(t))


def test_bf16_bit_patterns_survive():
    words = [0x7FC1, 0xFF80, 0x0001, 0x8000, 0x3F80]  # NaN with payload, -inf, denormal, -0, 1.0
    raw = torch.tensor([w - 0x10000 if w >= 0x8000 else w for w in words], dtype=torch.int16)
    bf = raw.view(torch.bfloat16)
    back = unflatten_bucket(flatten_bucket([("x", bf)]))[0][1]
    assert back.dtype == torch.bfloat16 and torch.equal(back.view(torch.int16), raw)


def test_flatten_errors():
    with pytest.raises(ValueError, match="empty"):
        flatten_bucket([])
    with pytest.raises(ValueError, match="duplicate.*'a'"):
        flatten_bucket([("a", torch.ones(2)), ("a", torch.ones(2))])
    with pytest.raises(ValueError, match="several devices"):
        flatten_bucket([("a", torch.ones(2)), ("b", torch.ones(2, device="meta"))])


def test_payload_passes_sglangs_unpickler_and_rebuilds():
    ts = _tensors()
    payload = sglang_bucket_payload(flatten_bucket(ts))
    data = serialize_for_sglang(payload, as_base64=False)
    assert data[:1] == b"\x80"  # pickle; SGLang normalizes raw bytes by this header
    for blob in (data, base64.b64decode(serialize_for_sglang(payload, as_base64=True), validate=True)):
        seen = []
        back = _receive(blob, seen=seen)
        assert ("types", "SimpleNamespace") in seen and set(seen) <= PINNED_ALLOWED
        assert [n for n, _ in back] == [n for n, _ in ts]
        for (_, t), (_, b) in zip(ts, back):
            assert b.dtype == t.dtype and b.shape == t.shape and torch.equal(_bits(b), _bits(t))


# -- outputs -----------------------------------------------------------------------------------
def _entry(lp, tid):
    return [lp, tid, None]  # [logprob, token_id, text]; text only with return_text_in_logprobs


GENERATE_RESPONSE = [  # /generate with three prompts, return_logprob=True (SGLang 0.5.23 shape)
    {"text": " 4", "output_ids": [220, 19, 151645],
     "meta_info": {"id": "a1", "finish_reason": {"type": "stop", "matched": 151645}, "prompt_tokens": 9,
                   "weight_version": "3", "num_retractions": 0, "input_token_logprobs": [],
                   "output_token_logprobs": [_entry(-0.25, 220), _entry(-0.01, 19), _entry(-1.5, 151645)],
                   "output_token_logprobs_length": 3, "reasoning_tokens": 0, "completion_tokens": 3,
                   "cached_tokens": 0, "e2e_latency": 0.05}},
    {"text": "x = 1", "output_ids": [87, 284, 220, 16, 271],
     "meta_info": {"id": "a2", "finish_reason": {"type": "stop", "matched": "\n\n"}, "prompt_tokens": 4,
                   "output_token_logprobs": [_entry(-0.5, 87), _entry(-0.2, 284), _entry(-0.3, 220),
                                             _entry(-0.1, 16), _entry(-0.7, 271)],
                   "completion_tokens": 5, "cached_tokens": 2}},
    {"text": "abc", "output_ids": [64, 65],
     "meta_info": {"id": "a3", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 4,
                   "output_token_logprobs": [_entry(-2.0, 64), _entry(-0.125, 65)], "completion_tokens": 2}},
]


def test_parse_generate_response():
    outs = [parse_generate_output(o, logprobs=True) for o in GENERATE_RESPONSE]
    assert outs[0].token_ids == [220, 19, 151645] and outs[0].text == " 4" and outs[0].finish_reason == "stop"
    assert outs[0].logprobs == [-0.25, -0.01, -1.5]
    assert outs[1].token_ids == [87, 284, 220, 16, 271] and outs[1].text == "x = 1"  # stop string not in text
    assert outs[1].finish_reason == "stop" and outs[1].logprobs[-1] == -0.7
    assert outs[2].finish_reason == "length" and outs[2].logprobs == [-2.0, -0.125]
    no_lp = parse_generate_output({"output_ids": [5], "meta_info": {"finish_reason": {"type": "length"}}}, False)
    assert no_lp.logprobs is None and no_lp.text == "" and no_lp.token_ids == [5]  # skip_tokenizer_init: no text


def test_parse_errors():
    bad = json.loads(json.dumps(GENERATE_RESPONSE[2]))
    bad["meta_info"]["output_token_logprobs"][1][1] = 99
    with pytest.raises(RuntimeError, match="a3.*do not match"):
        parse_generate_output(bad, logprobs=True)
    aborted = {"text": "", "output_ids": [], "meta_info": {"id": "z", "finish_reason": {
        "type": "abort", "message": "out of memory", "status_code": 500, "err_type": None}}}
    with pytest.raises(RuntimeError, match="aborted request z.*out of memory"):
        parse_generate_output(aborted, logprobs=True)
    with pytest.raises(RuntimeError, match="no output_token_logprobs"):
        parse_generate_output({"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}}, True)


ROUTE_LAYERS, ROUTE_TOPK = 3, 2


def _routes(prompt_len: int, outputs: int, salt: int = 0) -> np.ndarray:
    """An int32 ``[prompt + outputs - 1, layers, top_k]`` of distinct experts, as SGLang captures."""
    rows = prompt_len + outputs - 1
    return (np.arange(rows * ROUTE_LAYERS * ROUTE_TOPK, dtype=np.int32) * 7 + salt).reshape(
        rows, ROUTE_LAYERS, ROUTE_TOPK) % 64


def _with_routes(responses: list[dict], request: dict) -> list[dict]:
    """SGLang 0.5.23's answer to ``return_routed_experts``: ``meta_info["routed_experts"]``, the base64
    of the int32 ``[seqlen - 1, layers, top_k]`` bytes (detokenizer_manager._b64_encode_per_request)."""
    if not request.get("return_routed_experts"):
        return responses
    for i, (out, ids) in enumerate(zip(responses, request["input_ids"])):
        routes = _routes(len(ids), len(out["output_ids"]), salt=i)
        out["meta_info"]["routed_experts"] = base64.b64encode(routes.tobytes()).decode("utf-8")
    return responses


def test_routed_experts_are_decoded_per_position():
    out = _with_routes(json.loads(json.dumps(GENERATE_RESPONSE[:1])), {"return_routed_experts": True,
                                                                       "input_ids": [[5, 6, 7, 8]]})[0]
    got = parse_generate_output(out, logprobs=True, prompt_len=4)
    assert got.routed_experts.dtype == torch.int32 and got.routed_experts.shape == (4 + 3 - 1, 6)
    assert torch.equal(got.routed_experts, torch.from_numpy(_routes(4, 3)).reshape(6, 6))
    assert parse_generate_output(out, logprobs=True).routed_experts is None  # not asked for
    with pytest.raises(RuntimeError, match="whole number per each of its 7 positions"):
        parse_generate_output(out, logprobs=True, prompt_len=5)
    del out["meta_info"]["routed_experts"]
    with pytest.raises(RuntimeError, match="no routed_experts: start SGLang with enable_return_routed_experts"):
        parse_generate_output(out, logprobs=True, prompt_len=4)


def test_both_backends_ask_for_routed_experts_with_token_prompts(fake):
    params = SamplingParams(max_new_tokens=4, routed_experts=True)
    fe = FakeOfflineEngine()
    outs = SGLangEngine(engine=fe, tp_size=1).generate([[1, 2], [3, 4, 5]], params)
    assert fe.calls[0][1]["return_routed_experts"] is True
    assert [tuple(o.routed_experts.shape) for o in outs] == [(2 + 3 - 1, 6), (3 + 5 - 1, 6)]
    outs = _http_engine(fake).generate([[1, 2], [3, 4, 5]], params)
    assert fake.posts("/generate")[0]["return_routed_experts"] is True
    assert torch.equal(outs[1].routed_experts, torch.from_numpy(_routes(3, 5, salt=1)).reshape(7, 6))
    _http_engine(fake).generate([[1, 2]], SamplingParams())
    assert "return_routed_experts" not in fake.posts("/generate")[1]
    with pytest.raises(ValueError, match="routed_experts needs token-id prompts"):
        _http_engine(fake).generate(["a"], params)
    assert SGLangConfig(model_path="/m", enable_return_routed_experts=True).server_args()[
        "enable_return_routed_experts"] is True


@needs_src
def test_src_routed_experts_contract():
    """What the decoding relies on, in SGLang 0.5.23's source: the request flag (offline and HTTP), the
    rows ``[start_len, seqlen - 1)`` per request, int32 bytes in base64 under ``meta_info``."""
    engine = next(n for n in ast.walk(ast.parse(_src("sglang/srt/entrypoints/engine.py")))
                  if isinstance(n, ast.ClassDef) and n.name == "Engine")
    generate = next(f for f in engine.body if isinstance(f, ast.FunctionDef) and f.name == "generate")
    assert "return_routed_experts" in [a.arg for a in generate.args.args + generate.args.kwonlyargs]
    assert "return_routed_experts: bool = False" in _src("sglang/srt/managers/io_struct.py")
    assert "req_to_token[req_pool_idx][start_len : seqlen - 1]" in _src("sglang/srt/state_capturer/base.py")
    assert "seqlen = len(req.origin_input_ids) + len(req.output_ids_through_stop)" in _src(
        "sglang/srt/managers/scheduler_components/batch_result_processor.py")
    assert "pybase64.b64encode(item.numpy().tobytes())" in _src("sglang/srt/managers/detokenizer_manager.py")
    assert 'meta_info["routed_experts"] = val' in _src("sglang/srt/managers/tokenizer_manager.py")
    capturer = _src("sglang/srt/state_capturer/routed_experts.py")
    assert "dtype=torch.int32" in _src("sglang/srt/state_capturer/base.py") and "num_hidden_layers" in capturer


# -- a fake SGLang server ----------------------------------------------------------------------
class FakeSGLang:
    """Records every request; answers like SGLang 0.5.23's http_server.py."""

    def __init__(self):
        self.requests: list[tuple[str, str, object]] = []
        self.fail: dict[str, tuple[int, str]] = {}  # path -> (status, body), once
        self.health_503 = 0
        self.delay: dict[str, float] = {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, status, body, ctype="application/json"):
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

            def do_GET(self):
                fake.requests.append(("GET", self.path, None))
                if self.path == "/health_generate":
                    if fake.health_503 > 0:
                        fake.health_503 -= 1
                        return self._send(503, "")
                    return self._send(200, "")
                if self.path == "/server_info":
                    return self._send(200, {"version": "0.5.23", "tp_size": 2, "model_path": "/m"})
                self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                fake.requests.append(("POST", self.path, body))
                time.sleep(fake.delay.get(self.path, 0))
                if self.path in fake.fail:
                    status, text = fake.fail.pop(self.path)
                    return self._send(status, text)
                if self.path == "/generate":
                    k = len(body.get("text") or body.get("input_ids"))
                    return self._send(200, _with_routes(GENERATE_RESPONSE[:k], body))
                if self.path == "/flush_cache":
                    return self._send(200, "Cache flushed.\n", "text/plain")
                if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                    return self._send(200, "null")  # the route returns None
                if self.path in ("/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update"):
                    return self._send(200, {"success": True, "message": "Success"})
                self._send(404, {"detail": "Not Found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def posts(self, path):
        return [b for m, p, b in self.requests if m == "POST" and p == path]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    f = FakeSGLang()
    yield f
    f.close()


def _http_engine(fake, tp_size=2, **kw):
    kw = {"max_retries": 1, "backoff_s": 0.01, **kw}
    return SGLangEngine(client=SGLangHTTPClient(fake.url, **kw), tp_size=tp_size)


def test_http_generate_payload_and_order(fake):
    eng = _http_engine(fake)
    outs = eng.generate(["1+3=", "x?", "abc"], SamplingParams(max_new_tokens=8, temperature=0.7, seed=11))
    body = fake.posts("/generate")[0]
    assert body["text"] == ["1+3=", "x?", "abc"] and "input_ids" not in body and body["return_logprob"] is True
    assert [s["sampling_seed"] for s in body["sampling_params"]] == [11, 12, 13]
    assert body["sampling_params"][0] == {"max_new_tokens": 8, "temperature": 0.7, "top_p": 1.0, "sampling_seed": 11}
    assert [o.token_ids for o in outs] == [o["output_ids"] for o in GENERATE_RESPONSE]
    eng.generate([[1, 2], (3,)], SamplingParams(logprobs=False))
    body = fake.posts("/generate")[1]
    assert body["input_ids"] == [[1, 2], [3]] and body["return_logprob"] is False
    with pytest.raises(ValueError, match="all strings or all token-id"):
        eng.generate(["a", [1]], SamplingParams())
    assert eng.generate([], SamplingParams()) == [] and len(fake.posts("/generate")) == 2


def test_http_release_resume_flush(fake):
    eng = _http_engine(fake)
    eng.release_memory()
    eng.release_memory(["kv_cache"])  # already released: no call
    assert fake.posts("/release_memory_occupation") == [{"tags": list(MEMORY_TAGS)}]
    with pytest.raises(RuntimeError, match="resume_memory"):
        eng.generate(["a"], SamplingParams())
    eng.resume_memory(["weights"])
    eng.resume_memory()
    eng.resume_memory()  # nothing left: no call (SGLang would fail on an unknown tag)
    assert fake.posts("/resume_memory_occupation") == [{"tags": ["weights"]}, {"tags": ["kv_cache", "cuda_graph"]}]
    with pytest.raises(ValueError, match="unknown SGLang memory tags"):
        eng.release_memory(["gpu"])
    eng.flush_cache()
    assert ("POST", "/flush_cache", None) in fake.requests
    fake.fail["/flush_cache"] = (400, "requests are still running")
    with pytest.raises(RuntimeError, match=r"flush_cache .*HTTP 400.*still running"):
        eng.flush_cache()


def test_http_update_weights_contract(fake):
    eng = _http_engine(fake, tp_size=2)
    ts = _tensors()
    buckets = list(bucketize(ts, bucket_bytes=64))
    assert len(buckets) >= 3
    eng.update_weights(iter(buckets), version=7)
    paths = [p for m, p, _ in fake.requests if m == "POST"]
    assert paths == ["/begin_weight_update"] + ["/update_weights_from_tensor"] * len(buckets) + ["/end_weight_update"]
    assert fake.posts("/begin_weight_update") == [{"selector": "all"}]
    updates = fake.posts("/update_weights_from_tensor")
    assert [u["flush_cache"] for u in updates] == [False] * (len(buckets) - 1) + [True]
    assert [u.get("weight_version") for u in updates] == [None] * (len(buckets) - 1) + ["7"]
    received = []
    for u, bucket in zip(updates, buckets):
        assert u["load_format"] == LOAD_FORMAT == "flattened_bucket"
        assert len(u["serialized_named_tensors"]) == 2  # one payload per TP rank
        rank0 = _receive(base64.b64decode(u["serialized_named_tensors"][0], validate=True))
        assert [n for n, _ in rank0] == [n for n, _ in bucket]
        received += rank0
    for (n, t), (m, b) in zip(ts, received):
        assert n == m and b.dtype == t.dtype and torch.equal(_bits(b), _bits(t))
    assert eng.weight_version == 7


def test_http_update_failure_closes_the_session(fake):
    eng = _http_engine(fake)
    fake.fail["/update_weights_from_tensor"] = (400, json.dumps({"success": False, "message": "shape mismatch"}))
    with pytest.raises(RuntimeError, match="HTTP 400.*shape mismatch"):
        eng.update_weights([[("a", torch.ones(2))], [("b", torch.ones(2))]], version=3)
    assert [p for m, p, _ in fake.requests if m == "POST"][-1] == "/end_weight_update"
    assert eng.weight_version == 0
    with pytest.raises(ValueError, match="no buckets"):
        eng.update_weights([], version=4)


def test_success_false_is_an_error(fake):
    client = SGLangHTTPClient(fake.url)
    fake.fail["/begin_weight_update"] = (200, json.dumps({"success": False, "message": "already open"}))
    with pytest.raises(RuntimeError, match=re.escape(fake.url) + ".*begin_weight_update failed.*already open"):
        client.request("POST", "/begin_weight_update", "begin_weight_update", {})


def test_connect_reads_server_info_and_waits(fake):
    fake.health_503 = 1
    eng = SGLangEngine.connect(fake.url, ready_timeout_s=10, backoff_s=0.01)
    assert eng.tp_size == 2
    assert [p for m, p, _ in fake.requests if m == "GET"].count("/health_generate") == 2
    eng.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        eng.generate(["a"], SamplingParams())


def test_wait_until_ready_times_out(fake):
    fake.health_503 = 10**6
    client = SGLangHTTPClient(fake.url)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=re.escape(fake.url) + ".*not ready.*HTTP 503"):
        client.wait_until_ready(0.6, poll_s=0.1)
    assert time.monotonic() - t0 < 5


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_server_is_a_clear_bounded_error():
    url = f"http://127.0.0.1:{_closed_port()}"
    eng = SGLangEngine(client=SGLangHTTPClient(url, max_retries=2, backoff_s=0.05, connect_timeout_s=1), tp_size=1)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=re.escape(url) + r".*generate \(POST /generate\).*3 attempt"):
        eng.generate(["hi"], SamplingParams())
    assert time.monotonic() - t0 < 5
    with pytest.raises(ConnectionError, match=re.escape(url) + ".*release_memory_occupation"):
        eng.release_memory()
    with pytest.raises(ValueError, match="http://"):
        SGLangHTTPClient("localhost:30000")


def test_read_timeout_is_not_retried(fake):
    fake.delay["/generate"] = 1.5
    eng = _http_engine(fake, request_timeout_s=0.3, max_retries=3)
    with pytest.raises(TimeoutError, match=re.escape(fake.url) + ".*generate.*0.3s"):
        eng.generate(["a"], SamplingParams())
    assert len(fake.posts("/generate")) == 1  # a generate that may have run is not sent again


# -- the offline path against a fake sglang.Engine ---------------------------------------------
class FakeOfflineEngine:
    """The methods of ``sglang.Engine`` (0.5.23) this module calls, recording the calls."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.flush_ok = True

    def generate(self, **kw):
        self.calls.append(("generate", kw))
        n = len(kw.get("prompt") or kw.get("input_ids"))
        return _with_routes(json.loads(json.dumps(GENERATE_RESPONSE[:n])), kw)

    def begin_weight_update(self, selector="all"):
        self.calls.append(("begin_weight_update", {"selector": selector}))
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end_weight_update", {}))
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update_weights_from_tensor", {"named_tensors": named_tensors,
                                                          "load_format": load_format, "flush_cache": flush_cache}))
        return True, "Success"

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release_memory_occupation", {"tags": tags}))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume_memory_occupation", {"tags": tags}))

    def flush_cache(self):
        self.calls.append(("flush_cache", {}))
        return type("FlushCacheReqOutput", (), {"success": self.flush_ok, "message": "requests running"})()

    def shutdown(self):
        self.calls.append(("shutdown", {}))


def test_offline_engine_calls():
    fe = FakeOfflineEngine()
    eng = SGLangEngine(engine=fe, tp_size=1)
    outs = eng.generate(["a", "b"], SamplingParams(max_new_tokens=4))
    name, kw = fe.calls[0]
    assert name == "generate" and kw["prompt"] == ["a", "b"] and kw["return_logprob"] is True
    assert kw["sampling_params"] == [{"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0}] * 2
    assert outs[1].text == "x = 1"
    eng.generate([[1, 2, 3]], SamplingParams())
    assert fe.calls[1][1]["input_ids"] == [[1, 2, 3]] and "prompt" not in fe.calls[1][1]

    ts = _tensors()
    eng.update_weights([ts[:3], ts[3:]], version=2)
    names = [c for c, _ in fe.calls[2:]]
    assert names == ["begin_weight_update", "update_weights_from_tensor", "update_weights_from_tensor",
                     "end_weight_update"]
    ups = [kw for c, kw in fe.calls if c == "update_weights_from_tensor"]
    assert [u["flush_cache"] for u in ups] == [False, True] and {u["load_format"] for u in ups} == {LOAD_FORMAT}
    blob = ups[1]["named_tensors"][0]
    assert isinstance(blob, bytes)  # raw bytes offline, base64 only over HTTP
    assert [n for n, _ in _receive(blob)] == [n for n, _ in ts[3:]]
    assert eng.weight_version == 2

    eng.release_memory(["weights", "kv_cache"])
    eng.resume_memory()
    assert fe.calls[-2:] == [("release_memory_occupation", {"tags": ["weights", "kv_cache"]}),
                             ("resume_memory_occupation", {"tags": ["weights", "kv_cache"]})]
    fe.flush_ok = False
    with pytest.raises(RuntimeError, match="flush_cache failed: requests running"):
        eng.flush_cache()
    eng.shutdown()
    eng.shutdown()
    assert [c for c, _ in fe.calls].count("shutdown") == 1


def test_offline_update_failure_reports_sglangs_message():
    fe = FakeOfflineEngine()
    fe.update_weights_from_tensor = lambda **kw: (False, "must run between begin_weight_update() and ...")
    eng = SGLangEngine(engine=fe)
    with pytest.raises(RuntimeError, match="update_weights_from_tensor failed: must run between"):
        eng.update_weights([[("a", torch.ones(1))]], version=1)
    assert fe.calls[-1][0] == "end_weight_update" and eng.weight_version == 0


def test_engine_needs_one_backend():
    with pytest.raises(ValueError, match="exactly one"):
        SGLangEngine()
    with pytest.raises(ValueError, match="exactly one"):
        SGLangEngine(engine=FakeOfflineEngine(), client=SGLangHTTPClient("http://127.0.0.1:1"))


# -- against SGLang's own source (SGLANG_SRC) --------------------------------------------------
def _src(rel: str) -> str:
    return (Path(SGLANG_SRC) / rel).read_text()


@needs_src
def test_src_version_and_server_arg_names():
    assert f"__version__ = version = '{SGLANG_VERSION}'" in _src("sglang/_version.py")
    fields = set()
    for f in (Path(SGLANG_SRC) / "sglang/srt/arg_groups/fields").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                fields.add(node.target.id)
    assert SERVER_ARG_NAMES <= fields, SERVER_ARG_NAMES - fields
    assert "cli_name=" not in "".join(  # flags are --field-name for the fields used here
        seg for seg in re.split(r"\n    (?=\w+: A\[)", "".join(
            p.read_text() for p in (Path(SGLANG_SRC) / "sglang/srt/arg_groups/fields").glob("*.py")))
        if seg.split(":")[0].strip() in SERVER_ARG_NAMES)


@needs_src
def test_src_endpoints_sampling_names_and_tags():
    http = _src("sglang/srt/entrypoints/http_server.py")
    for route in ("/generate", "/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update",
                  "/release_memory_occupation", "/resume_memory_occupation", "/flush_cache", "/health_generate",
                  "/server_info"):
        assert re.search(r'@app\.(get|post|api_route)\(\s*"' + re.escape(route) + '"', http), route
    api = ast.parse(_src("sglang/api/v1/api_types.py"))
    cls = next(n for n in api.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    assert SAMPLING_PARAM_NAMES <= {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)}
    consts = _src("sglang/srt/constants.py")
    for tag in MEMORY_TAGS:
        assert f'= "{tag}"' in consts
    assert 'if load_format == "flattened_bucket"' in _src("sglang/srt/entrypoints/engine.py")


@needs_src
def test_src_bucket_format_and_unpickler_allowlist():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_sgl_tensor_bucket",
                                                  Path(SGLANG_SRC) / "sglang/srt/weight_sync/tensor_bucket.py")
    tb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tb)
    ts = _tensors()
    aligned = [ts[i] for i in (1, 3, 0, 2, 5, 6, 4)]  # contiguous, no padding needed: SGLang's layout
    theirs, mine = tb.FlattenedTensorBucket(named_tensors=aligned), flatten_bucket(aligned)
    assert torch.equal(theirs.get_flattened_tensor(), mine.flattened_tensor)
    assert [(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel) for m in theirs.get_metadata()] == \
        [(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel) for m in mine.metadata]
    with pytest.raises(RuntimeError, match="divisible"):  # SGLang's unpadded layout (bf16 x35, fp32) fails
        tb.FlattenedTensorBucket(named_tensors=ts[:2]).reconstruct_tensors()
    with pytest.raises(RuntimeError, match="stride"):  # and it cannot take the strided view ts[7]
        tb.FlattenedTensorBucket(named_tensors=ts[7:])
    payload = sglang_bucket_payload(flatten_bucket(ts))
    rebuilt = tb.FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"], metadata=payload["metadata"])
    for (n, t), (m, b) in zip(ts, rebuilt.reconstruct_tensors()):
        assert n == m and torch.equal(_bits(b), _bits(t))
    common = ast.parse(_src("sglang/srt/utils/common.py"))
    safe = next(n for n in ast.walk(common) if isinstance(n, ast.ClassDef) and n.name == "SafeUnpickler")
    allowed = next(ast.literal_eval(s.value) for s in safe.body
                   if isinstance(s, ast.Assign) and s.targets[0].id == "ALLOWED_GLOBALS")
    assert PINNED_ALLOWED <= allowed, PINNED_ALLOWED - allowed
    assert [n for n, _ in _receive(serialize_for_sglang(payload, as_base64=False), allowed)] == [n for n, _ in ts]


# -- launch and offline construction with stand-ins ------------------------------------------
FAKE_SERVER = '''
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
json.dump({"argv": argv, "raw": os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB")}, open(os.environ["REC"], "w"))
if os.environ.get("EXIT"):
    sys.exit(int(os.environ["EXIT"]))
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()
HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), H).serve_forever()
'''


def _fake_python(tmp_path):
    (tmp_path / "server.py").write_text(FAKE_SERVER)
    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\nshift 2\nexec {sys.executable} {tmp_path / 'server.py'} \"$@\"\n")  # drop -m MODULE
    exe.chmod(0o755)
    return str(exe)


def test_launch_starts_waits_and_stops_the_server(tmp_path, monkeypatch):
    monkeypatch.setenv("REC", str(tmp_path / "rec.json"))
    cfg = SGLangConfig(model_path="/m", tp_size=2, port=_closed_port())
    eng = SGLangEngine.launch(cfg, ready_timeout_s=30, python=_fake_python(tmp_path), backoff_s=0.01)
    proc = eng._process
    rec = json.loads((tmp_path / "rec.json").read_text())
    assert rec["raw"] == "1" and rec["argv"][rec["argv"].index("--tp-size") + 1] == "2"
    assert rec["argv"][rec["argv"].index("--model-path") + 1] == "/m" and "--enable-memory-saver" in rec["argv"]
    assert proc.poll() is None and eng.tp_size == 2
    eng.shutdown()
    assert proc.poll() is not None


def test_launch_reports_a_server_that_exits(tmp_path, monkeypatch):
    monkeypatch.setenv("REC", str(tmp_path / "rec.json"))
    monkeypatch.setenv("EXIT", "3")
    cfg = SGLangConfig(model_path="/m", port=_closed_port())
    with pytest.raises(RuntimeError, match=r"127\.0\.0\.1.*exited with code 3"):
        SGLangEngine.launch(cfg, ready_timeout_s=30, python=_fake_python(tmp_path))


def test_offline_builds_sglang_engine_from_the_config(monkeypatch):
    import types

    import cooper_mcore.rollout.sglang_engine as mod

    made = []
    fake_sglang = types.SimpleNamespace(__version__="0.5.23",
                                        Engine=lambda **kw: made.append(kw) or FakeOfflineEngine())
    monkeypatch.setitem(sys.modules, "sglang", fake_sglang)
    monkeypatch.setattr(mod, "installed_server_arg_names", lambda: SERVER_ARG_NAMES | {"disable_radix_cache"})
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    cfg = SGLangConfig(model_path="/m", tp_size=2, extra_server_args={"disable_radix_cache": True})
    eng = SGLangEngine.offline(cfg)
    assert made == [cfg.server_args()] and eng.tp_size == 2
    assert os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    with pytest.raises(ValueError, match="not SGLang ServerArgs fields: \\['nope'\\]"):
        SGLangEngine.offline(SGLangConfig(model_path="/m", extra_server_args={"nope": 1}))
    assert len(made) == 1


@needs_src
def test_src_engine_methods_and_request_fields():
    def cls_of(rel, name):
        return next(n for n in ast.walk(ast.parse(_src(rel))) if isinstance(n, ast.ClassDef) and n.name == name)

    engine = cls_of("sglang/srt/entrypoints/engine.py", "Engine")
    methods = {f.name: [a.arg for a in f.args.args + f.args.kwonlyargs] for f in engine.body
               if isinstance(f, ast.FunctionDef)}
    assert {"prompt", "input_ids", "sampling_params", "return_logprob"} <= set(methods["generate"])
    assert methods["update_weights_from_tensor"] == ["self", "named_tensors", "load_format", "flush_cache"]
    assert methods["begin_weight_update"] == ["self", "selector"] and methods["end_weight_update"] == ["self"]
    for op in ("release_memory_occupation", "resume_memory_occupation"):
        assert methods[op] == ["self", "tags"]
    assert "flush_cache" in methods and "shutdown" in methods
    io_struct = "sglang/srt/managers/io_struct.py"

    def fields(name):
        return {s.target.id for s in cls_of(io_struct, name).body if isinstance(s, ast.AnnAssign)}

    assert {"serialized_named_tensors", "load_format", "flush_cache", "weight_version"} <= \
        fields("UpdateWeightsFromTensorReqInput")
    assert fields("BeginWeightUpdateReqInput") == {"selector"}
    assert fields("ReleaseMemoryOccupationReqInput") == fields("ResumeMemoryOccupationReqInput") == {"tags"}


# -- ports, CPU engines, logging, per-rank payloads ---------------------------------------------
def test_ports_come_from_the_local_rank(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    args = SGLangConfig(model_path="/m").server_args()
    assert (args["port"], args["nccl_port"]) == (30000, 30001)
    monkeypatch.setenv("LOCAL_RANK", "2")
    args = SGLangConfig(model_path="/m").server_args()
    assert (args["port"], args["nccl_port"]) == (30020, 30021)
    used = [SGLangConfig(model_path="/m", local_rank=r) for r in range(8)]  # the engines of one node
    ports = [p for c in used for p in (c.resolved_port(), c.resolved_nccl_port())]
    assert len(set(ports)) == 16
    cfg = SGLangConfig(model_path="/m", port=31000)
    assert (cfg.resolved_port(), cfg.resolved_nccl_port()) == (31000, 31001)
    argv = server_command(SGLangConfig(model_path="/m", local_rank=1), python="py")
    assert argv[argv.index("--port") + 1] == "30010" and argv[argv.index("--nccl-port") + 1] == "30011"


@pytest.mark.parametrize("fields,match", [
    ({"port_stride": 1}, "port_stride"), ({"port": 31000, "nccl_port": 31000}, "nccl_port must differ"),
    ({"local_rank": 7000}, "port must be in"), ({"device": "tpu"}, "device"),
    ({"max_total_tokens": 0}, "max_total_tokens"),
])
def test_port_and_device_errors_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        SGLangConfig(model_path="/m", **fields).server_args()


def test_bad_local_rank_env(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        SGLangConfig(model_path="/m").server_args()


def test_cpu_config():
    cfg = SGLangConfig.cpu("/m", tokenizer_path="/t", port=31000)
    args = cfg.server_args()
    assert args["device"] == "cpu" and args["attention_backend"] == "torch_native" and args["dtype"] == "float32"
    assert args["disable_cuda_graph"] is True and args["enable_memory_saver"] is False
    assert args["max_total_tokens"] == 4096 and "base_gpu_id" not in args and args["sleep_on_idle"] is True
    assert cfg.engine_env() == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "SGLANG_USE_CPU_ENGINE": "1"}
    argv = server_cli_args(args)
    assert "--disable-cuda-graph" in argv and "--enable-memory-saver" not in argv
    assert argv[argv.index("--attention-backend") + 1] == "torch_native"
    gpu = SGLangConfig(model_path="/m").server_args()
    assert gpu["device"] == "cuda" and gpu["enable_memory_saver"] is True and "attention_backend" not in gpu
    assert SGLangConfig(model_path="/m").engine_env() == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
    with pytest.raises(ValueError, match="enable_memory_saver needs device='cuda'"):
        SGLangConfig.cpu("/m", enable_memory_saver=True).server_args()
    with pytest.raises(ValueError, match="enable_deterministic_inference.*torch_native"):
        SGLangConfig.cpu("/m", enable_deterministic_inference=True).server_args()
    # refused before start: SGLang 0.5.23's CPU scheduler dies in cudaHostRegister (tests/sglang/test_moe.py)
    with pytest.raises(ValueError, match="enable_return_routed_experts needs device='cuda'.*rollout.engine=hf"):
        SGLangConfig.cpu("/m", enable_return_routed_experts=True).server_args()


def test_offline_keeps_the_trainers_logging(monkeypatch, tmp_path):
    """sglang.Engine runs logging.basicConfig(force=True, level=...) in this process: the handlers,
    level and filters of the root logger are back afterwards, and a file handler is not closed."""
    import logging
    import types

    import cooper_mcore.rollout.sglang_engine as mod

    def engine_that_configures_logging(**kw):
        logging.basicConfig(level=logging.ERROR, format="[sglang] %(message)s", force=True)
        logging.getLogger("sglang.srt").info("sglang's own line")
        return FakeOfflineEngine()

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(__version__="0.5.23",
                                                                     Engine=engine_that_configures_logging))
    monkeypatch.setattr(mod, "installed_server_arg_names", lambda: SERVER_ARG_NAMES)
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, list(root.filters))
    handler = logging.FileHandler(tmp_path / "trainer.log")
    keep = logging.Filter("cooper_mcore")
    try:
        for h in list(root.handlers):
            root.removeHandler(h)
        root.addHandler(handler)
        root.addFilter(keep)
        root.setLevel(logging.INFO)
        SGLangEngine.offline(SGLangConfig(model_path="/m"))
        assert root.handlers == [handler] and root.level == logging.INFO and root.filters == [keep]
        logging.getLogger("cooper_mcore.rl").info("trainer line after the engine")
        handler.flush()
        assert "trainer line after the engine" in (tmp_path / "trainer.log").read_text()
        # the control: without the guard the same engine start silences the trainer
        engine_that_configures_logging()
        assert handler not in root.handlers and root.level == logging.ERROR
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        root.filters[:] = []
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
        root.filters[:] = saved[2]
        handler.close()


def test_cpu_engine_release_only_marks():
    fe = FakeOfflineEngine()
    eng = SGLangEngine(engine=fe, device="cpu")
    eng.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        eng.generate(["a"], SamplingParams())
    eng.resume_memory()
    assert [c for c, _ in fe.calls] == []  # SGLang's CPU scheduler dies on release_memory_occupation
    eng.generate(["a"], SamplingParams())
    with pytest.raises(ValueError, match="device"):
        SGLangEngine(engine=fe, device="tpu")


def test_update_weights_from_payloads_per_rank():
    fe = FakeOfflineEngine()
    eng = SGLangEngine(engine=fe, tp_size=2)
    ts = _tensors()
    per_rank = [[rank_payload(ts[:4], as_base64=False), rank_payload(ts[:4], as_base64=False)],
                [rank_payload(ts[4:], as_base64=False), rank_payload(ts[4:], as_base64=False)]]
    eng.update_weights_from_payloads(per_rank, version=5)
    ups = [kw for c, kw in fe.calls if c == "update_weights_from_tensor"]
    assert [u["named_tensors"] for u in ups] == per_rank and [u["flush_cache"] for u in ups] == [False, True]
    assert [n for n, _ in _receive(ups[1]["named_tensors"][1])] == [n for n, _ in ts[4:]]
    assert eng.weight_version == 5
    with pytest.raises(ValueError, match=r"1 payloads for a bucket, expected one per TP rank \(2\)"):
        eng.update_weights_from_payloads([[per_rank[0][0]]], version=6)
    assert fe.calls[-1][0] == "end_weight_update" and eng.weight_version == 5
    eng.update_weights([ts[:2]], version=7)  # one payload per rank, each pickled on its own
    blobs = [kw for c, kw in fe.calls if c == "update_weights_from_tensor"][-1]["named_tensors"]
    assert len(blobs) == 2 and blobs[0] is not blobs[1]


def test_http_payloads_given_as_bytes_are_sent_as_base64(fake):
    """The weight sync's per-rank payloads are raw pickles (the ranks do not know the engine's mode);
    over HTTP they must reach SGLang base64-encoded, the same bytes."""
    eng = _http_engine(fake)
    raw = [rank_payload(_tensors()[:2], as_base64=False) for _ in range(2)]
    eng.update_weights_from_payloads([raw], version=3)
    sent = fake.posts("/update_weights_from_tensor")[0]["serialized_named_tensors"]
    assert [base64.b64decode(s, validate=True) for s in sent] == raw


def test_engine_shutdown_kills_only_the_engines_processes(monkeypatch):
    """sglang.Engine.shutdown kills every child of this process; within _kill_only it kills the engine's."""
    import os
    import sys
    import types

    from cooper_mcore.rollout.sglang_engine import _kill_only

    calls = []
    fake = types.ModuleType("sglang.srt.entrypoints.engine")
    fake.kill_process_tree = lambda pid, include_parent=True, **kw: calls.append((pid, include_parent))
    for name in ("sglang", "sglang.srt", "sglang.srt.entrypoints"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.entrypoints.engine", fake)
    original = fake.kill_process_tree
    with _kill_only(frozenset({222, 111})):
        fake.kill_process_tree(os.getpid(), include_parent=False, wait_timeout=60)  # what shutdown calls
        fake.kill_process_tree(999)  # any other tree is left to SGLang
    assert calls == [(111, True), (222, True), (999, True)]
    assert fake.kill_process_tree is original
