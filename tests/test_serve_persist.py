"""--responses-store-dir: the stored responses and conversations as files, read back by the next server, in the
order of their use; what is deleted or dropped leaves no file; a restart fails a background response it cut off."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pocketmoe.serve.conversations import ConversationStore
from pocketmoe.serve.protocol import RequestError
from pocketmoe.serve.responses import ResponseStore
from pocketmoe.testing.live_server import LiveServer
from pocketmoe.testing.synth import write_fixture

ROOT = Path(__file__).resolve().parents[1]


def made(k: int, status: str = "completed") -> dict:
    return {"id": f"resp_{k}", "status": status,
            "output": [{"type": "message", "role": "assistant", "content": f"turn {k}"}]}


def test_responses_come_back_in_their_order_of_use(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    size = len(json.dumps(made(0))) + len(json.dumps([]))
    store = ResponseStore(size * 5 // 2, tmp_path)  # room for two
    assert store.put(made(0), [], None) and store.put(made(1), [], "resp_0")
    store.get("resp_0")  # read: resp_1 is now the least recently used
    assert store.put(made(2), [], "resp_0")  # resp_1 goes, and its file
    assert sorted(p.name for p in (tmp_path / "responses").iterdir()) == ["resp_0.json", "resp_2.json"]
    store.get("resp_0")

    again = ResponseStore(size * 5 // 2, tmp_path)
    assert len(again) == 2 and again.size == store.size
    assert again.get("resp_2").response == made(2) and again.get("resp_2").previous == "resp_0"
    assert [x.content for x in again.conversation("resp_2")] == ["turn 0", "turn 2"]  # resp_2 now the latest used
    assert again.put(made(3), [], None)  # resp_0, the least recently used, goes
    with pytest.raises(RequestError, match="no stored response 'resp_0'"):
        again.get("resp_0")
    again.delete("resp_3")
    assert sorted(p.name for p in (tmp_path / "responses").iterdir()) == ["resp_2.json"]

    again.put(made(4, "in_progress"), [], None)  # a background response the server stopped in
    (tmp_path / "responses" / "resp_9.json").write_text("{not json")
    (tmp_path / "responses" / "notes.txt").write_text("left alone")
    with caplog.at_level(logging.WARNING, logger="pocketmoe.serve"):
        third = ResponseStore(size * 4, tmp_path)  # room for the error the failed one now carries
    assert "resp_9.json" in caplog.text
    failed = third.get("resp_4").response
    assert failed["status"] == "failed" and "stopped" in failed["error"]["message"]
    assert json.loads((tmp_path / "responses" / "resp_4.json").read_text())["response"]["status"] == "failed"
    assert (tmp_path / "responses" / "notes.txt").exists() and len(third) == 2
    before = sorted(p.name for p in (tmp_path / "responses").iterdir())
    assert len(ResponseStore(0, tmp_path)) == 0  # a server that keeps none leaves the files be
    assert sorted(p.name for p in (tmp_path / "responses").iterdir()) == before


def test_conversations_come_back_as_they_were_left(tmp_path: Path) -> None:
    def item(k: int) -> dict:
        return {"id": f"msg_{k}", "type": "message", "role": "user", "content": [{"type": "input_text",
                                                                                  "text": f"m{k}"}]}

    store = ConversationStore(2000, tmp_path)
    a = store.create([item(1), item(2)], {"topic": "cats"})
    b = store.create([item(3)], {})
    store.add(a.id, [item(4)])
    store.remove_item(a.id, "msg_2")
    store.set_metadata(b.id, {"topic": "dogs"})
    gone = store.create([], {})
    store.delete(gone.id)

    again = ConversationStore(2000, tmp_path)
    assert len(again) == 2 and again.size == store.size
    assert [x["id"] for x in again.get(a.id).items] == ["msg_1", "msg_4"]
    assert again.get(a.id).metadata == {"topic": "cats"} and again.get(b.id).metadata == {"topic": "dogs"}
    assert again.get(a.id).created_at == a.created_at
    with pytest.raises(RequestError, match="no conversation"):
        again.get(gone.id)
    room = again.get(a.id).size + 10
    again.get(b.id)
    small = ConversationStore(room, tmp_path)  # room for one: b, used last, stays
    assert len(small) == 1 and small.get(b.id)
    assert [p.stem for p in (tmp_path / "conversations").iterdir()] == [b.id]


def test_a_restarted_server_continues_the_stored_conversation(tmp_path: Path) -> None:
    model = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path / "m.gguf", seed=3)[0]
    args = ["--model", str(model), "--served-model-name", "m", "--max-model-len", "256", "--threads", "1",
            "--responses-store-dir", str(tmp_path / "store")]
    with LiveServer(args) as srv:
        c = httpx.Client(base_url=srv.url, timeout=60)
        first = c.post("/v1/responses", json={"model": "m", "input": "hello", "max_output_tokens": 4}).json()
        conv = c.post("/v1/conversations", json={"items": [{"type": "message", "role": "user",
                                                             "content": "hi"}]}).json()
        c.post("/v1/responses", json={"model": "m", "input": "and?", "conversation": conv["id"],
                                      "max_output_tokens": 3}).raise_for_status()
        items = c.get(f"/v1/conversations/{conv['id']}/items").json()
    with LiveServer(args) as srv:
        c = httpx.Client(base_url=srv.url, timeout=60)
        assert c.get(f"/v1/responses/{first['id']}").json() == first
        r = c.post("/v1/responses", json={"model": "m", "input": "more", "previous_response_id": first["id"],
                                          "max_output_tokens": 3})
        assert r.status_code == 200, r.text
        assert c.get(f"/v1/conversations/{conv['id']}/items").json() == items
        assert c.delete(f"/v1/conversations/{conv['id']}").status_code == 200
    assert not (tmp_path / "store" / "conversations" / f"{conv['id']}.json").exists()


def test_a_store_dir_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    r = subprocess.run([sys.executable, "-m", "pocketmoe.serve", "--responses-store-dir", str(tmp_path / "file" / "d"),
                        "--port", "0"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and "--responses-store-dir" in lines[0], r.stderr
