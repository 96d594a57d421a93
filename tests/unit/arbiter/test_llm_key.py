"""The arbiter's one-token probe carries vLLM's own key (config key ``vllm_api_key_file``).

Against the lab's vLLM stand-in started with ``--api-key`` (it guards ``/v1`` as vLLM's
``AuthenticationMiddleware`` does): the probe passes with the key file, is refused (401)
without it or with a wrong key, and says which file when the file cannot give a key.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from arbiter_fakes import make_config

from cardshare.arbiter.config import ConfigError, parse_config
from cardshare.arbiter.edges import HttpLlm, Rejected, Unavailable

STANDINS = Path(__file__).resolve().parents[3] / "lab" / "standins"
if str(STANDINS) not in sys.path:
    sys.path.insert(0, str(STANDINS))

import vllm_standin as vs  # noqa: E402 - needs the path above
from standin_http import serve_in_thread  # noqa: E402

KEY = "k3y-of-vllm"


@pytest.fixture
def vllm_url() -> Iterator[str]:
    settings = vs.prepare(
        ["serve", "m", "--max-model-len", "4096", "--api-key", KEY],
        {"STANDIN_TOKEN_SECONDS": "0"},
    )
    srv = vs.make_server(settings, None, port=0)
    srv.server_address = ("127.0.0.1", srv.server_address[1])
    serve_in_thread(srv)
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


async def probe(tmp_path: Path, url: str, key_file: Path | None) -> None:
    config = make_config(tmp_path, vllm_url=url, vllm_api_key_file=key_file)
    async with aiohttp.ClientSession() as session:
        await HttpLlm(session, config).one_token()


async def test_the_probe_passes_with_the_key(tmp_path: Path, vllm_url: str) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    await probe(tmp_path, vllm_url, key_file)


async def test_without_the_key_vllm_refuses_the_probe(tmp_path: Path, vllm_url: str) -> None:
    with pytest.raises(Rejected) as caught:
        await probe(tmp_path, vllm_url, None)
    assert (caught.value.status, caught.value.detail) == (401, {"error": "Unauthorized"})
    # the message names the setting that is missing and where the key is
    assert str(caught.value).endswith(
        'answered 401: {"error":"Unauthorized"}; vLLM asks for its key and vllm_api_key_file is'
        " not set: set it to vLLM's key file (the vllm role's vllm_api_key_file; the arbiter"
        " role's arbiter_vllm_api_key_file)"
    ), str(caught.value)


async def test_a_wrong_key_is_refused(tmp_path: Path, vllm_url: str) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("not-the-key\n")
    with pytest.raises(Rejected, match="answered 401") as caught:
        await probe(tmp_path, vllm_url, key_file)
    assert caught.value.status == 401
    assert str(caught.value).endswith(
        f"; vLLM refused the key of vllm_api_key_file {key_file}: it must hold vLLM's key (the"
        " vllm role's vllm_api_key_file)"
    ), str(caught.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot be read"),
        ("", "has no key on its first line"),
        ("two words\n", "has no key on its first line"),
    ],
)
async def test_a_key_file_without_a_key_says_which_file(
    tmp_path: Path, vllm_url: str, content: str | None, message: str
) -> None:
    key_file = tmp_path / "key"
    if content is not None:
        key_file.write_text(content)
    with pytest.raises(Unavailable, match=f"vLLM's key file {key_file} {message}"):
        await probe(tmp_path, vllm_url, key_file)


def test_the_config_takes_an_absolute_key_file() -> None:
    base = {
        "data_dir": "/d",
        "vllm_url": "http://127.0.0.1:8000",
        "served_model_name": "m",
        "comfyui_url": "http://127.0.0.1:8188",
        "card_current_json": "/d/current.json",
        "token_file": "/t",
    }
    assert parse_config(base).vllm_api_key_file is None
    key = "/run/secrets/cardshare-vllm-key/key"
    assert parse_config({**base, "vllm_api_key_file": key}).vllm_api_key_file == Path(key)
    with pytest.raises(ConfigError, match="config key 'vllm_api_key_file' has value 'key'"):
        parse_config({**base, "vllm_api_key_file": "key"})
