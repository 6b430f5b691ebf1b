"""OpenAI's Conversations API through the OpenAI SDK (its types check the shapes): a conversation's items are made,
listed, read and deleted; a Responses turn with `conversation` renders the prompt the whole conversation renders
when sent in input, and joins the conversation; what cannot be kept or read is a clear 4xx."""

from __future__ import annotations

import openai
import pytest

from pocketmoe.serve.conversations import ConversationStore
from pocketmoe.testing.scripted import MM_CALL, TOOLS, client_for, thinking_tokenizer
from pocketmoe.tokenizer import Tokenizer

RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
THINK = "Check the weather first.\n</think>\n\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:  # noqa: ANN001
    return thinking_tokenizer(tmp_path_factory.mktemp("conversations"))


def test_items_are_made_listed_read_and_deleted(tok: Tokenizer) -> None:
    c, _ = client_for(tok, "ok")
    conv = c.conversations.create(items=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                                  metadata={"topic": "greeting"})
    assert conv.id.startswith("conv_") and conv.object == "conversation" and conv.metadata == {"topic": "greeting"}
    assert c.conversations.retrieve(conv.id).model_dump() == conv.model_dump()
    added = c.conversations.items.create(conv.id, items=[{"role": "user", "content": f"q{k}"} for k in range(3)])
    assert [x.content[0].text for x in added.data] == ["q0", "q1", "q2"] and added.has_more is False
    every = list(c.conversations.items.list(conv.id, order="asc", limit=2))  # the SDK pages through them
    assert [x.content[0].text for x in every] == ["hi", "hello", "q0", "q1", "q2"]
    newest = c.conversations.items.list(conv.id, limit=2)
    assert [x.content[0].text for x in newest.data] == ["q2", "q1"] and newest.has_more
    one = c.conversations.items.retrieve(every[2].id, conversation_id=conv.id)
    assert one.id == every[2].id and one.content[0].text == "q0"
    assert c.conversations.items.delete(every[2].id, conversation_id=conv.id).id == conv.id
    assert [x.id for x in c.conversations.items.list(conv.id, order="asc")] == [x.id for x in every if x != every[2]]
    assert c.conversations.update(conv.id, metadata={"topic": "other"}).metadata == {"topic": "other"}
    gone = c.conversations.delete(conv.id)
    assert (gone.id, gone.deleted, gone.object) == (conv.id, True, "conversation.deleted")
    with pytest.raises(openai.NotFoundError, match="no conversation"):
        c.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError, match="no item"):
        c.conversations.items.retrieve("msg_nope", conversation_id=c.conversations.create().id)


def test_a_turn_with_a_conversation_renders_and_joins_it(tok: Tokenizer) -> None:
    """The prompt of a turn that names its conversation is the prompt of the whole conversation sent in input; the
    turn's input and output items join the conversation, and a second turn continues from them."""
    c, eng = client_for(tok, THINK + MM_CALL)
    conv = c.conversations.create(items=[{"role": "user", "content": "I am in France."}])
    first = c.responses.create(model="m", conversation=conv.id, input="weather in Paris?", tools=RESPONSES_TOOLS)
    assert first.conversation.id == conv.id
    whole = [{"role": "user", "content": "I am in France."}, {"role": "user", "content": "weather in Paris?"}]
    with_conv = eng.prompts[-1]
    c.responses.create(model="m", input=whole, tools=RESPONSES_TOOLS, store=False)
    assert with_conv == eng.prompts[-1]
    kept = list(c.conversations.items.list(conv.id, order="asc"))
    assert [x.type for x in kept] == ["message", "message", *[it.type for it in first.output]]
    assert [x.id for x in kept[2:]] == [it.id for it in first.output]
    results = [{"type": "function_call_output", "call_id": it.call_id, "output": f"result {k}"}
               for k, it in enumerate(it for it in first.output if it.type == "function_call")]
    c.responses.create(model="m", conversation={"id": conv.id}, input=results, tools=RESPONSES_TOOLS, store=False)
    continued = eng.prompts[-1]
    history = [*whole, *[it.model_dump(exclude_none=True) for it in first.output], *results]
    c.responses.create(model="m", input=history, tools=RESPONSES_TOOLS, store=False)
    assert continued == eng.prompts[-1]
    assert len(list(c.conversations.items.list(conv.id))) == len(kept) + len(results) + len(first.output)
    count = c.responses.input_tokens.count(model="m", conversation=conv.id, input="and Rome?", tools=RESPONSES_TOOLS)
    assert count.input_tokens > len(with_conv)


def test_what_cannot_be_kept_or_read(tok: Tokenizer) -> None:
    c, eng = client_for(tok, "ok")
    with pytest.raises(openai.NotFoundError, match="no conversation"):
        c.responses.create(model="m", conversation="conv_nope", input="hi")
    with pytest.raises(openai.BadRequestError, match="items"):
        c.conversations.create(items=[{"role": "user", "content": "x"}] * 21)
    with pytest.raises(openai.BadRequestError) as bad:
        c.conversations.create(items=[{"role": "user", "content": "ok"}, {"type": "image_generation_call", "id": "x"}])
    assert bad.value.body["param"] == "items.1.type" and "items[1]" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="limit"):
        c.conversations.items.list(c.conversations.create().id, limit=0)
    assert not eng.prompts


def test_store_keeps_the_most_recently_used_within_its_bytes() -> None:
    from pocketmoe.serve.protocol import RequestError

    item = {"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 100}]}
    store = ConversationStore(1000)
    first, second = store.create([item], {}), store.create([item], {})
    store.get(first.id)  # used: the second is now the least recently used
    third = store.create([item] * 3, {})
    assert len(store) == 2 and store.size <= 1000
    with pytest.raises(RequestError, match="no conversation"):
        store.get(second.id)
    assert store.get(first.id) and store.get(third.id)
    with pytest.raises(RequestError, match="more than the server keeps"):
        store.add(third.id, [item] * 20)
    with pytest.raises(RequestError, match="no conversation"):
        store.get(third.id)
    with pytest.raises(RequestError, match="keeps no conversations"):
        ConversationStore(0).create([], {})
