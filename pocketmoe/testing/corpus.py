"""A small mixed text sample (English, code, CJK, numbers, emoji) that fixture vocabularies learn from."""

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, but the fox did not care.
Mixture-of-experts models route every token to a few experts out of many. Each expert is a small
feed-forward network, and the router picks the ones with the highest scores for the current token.
Because only the selected experts run, the model can be very large while each step stays cheap.
When the weights do not fit on the graphics card, the experts can live in host memory instead, and
the engine copies only the experts that the router chose. The rest of the network stays on the device.
It's a simple idea: move what you need, when you need it, and keep the hot experts in a cache.
We're measuring tokens per second, gigabytes per second, and the time to the first token.
They've tested it on a laptop with 4 GB of memory and on a server with 8 GPUs and 512 GB of RAM.
In 2024 the model had 236 billion parameters; 21 billion of them were active for each token.
Version 1.2.3 was released on 2025-03-14 at 09:30, and version 2.0 followed 6 months later.
Prices: $19.99, 42%, 3.14159, 1,000,000 and 0x1F. Call +1 (555) 010-2030 or mail info@example.com.
Hello, world! How are you today? I'm fine, thanks. "Quotes" and 'single quotes' (parentheses) [brackets].
Questions? Answers! Lists: one, two, three... and so on; semicolons; colons: done.

def route(hidden, weight, top_k=6):
    scores = torch.softmax(hidden @ weight.T, dim=-1)
    values, indices = torch.topk(scores, k=top_k, dim=-1)
    return values, indices


class ExpertCache:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.entries = {}

    def lookup(self, layer: int, expert: int):
        key = (layer, expert)
        if key in self.entries:
            return self.entries[key]
        return None

for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }
if (x != y && y >= 0 || z <= -1) { return x->next; }
# comment: the end of the code sample

混合专家模型把每个词元分配给少数几个专家。每个专家都是一个小的前馈网络，路由器根据分数选择专家。
当权重放不进显卡时，专家可以放在主机内存里，引擎只复制被选中的专家。我们今天测试了模型的速度。
你好，世界！今天天气很好。中文、标点符号和数字１２３都在这里。
日本語のテキストもあります。こんにちは、世界！カタカナとひらがなを少し使います。
한국어 문장도 있습니다. 안녕하세요, 세계! 오늘은 날씨가 좋습니다.
Ελληνικά: καλημέρα κόσμε. Русский: привет, мир! Français: « déjà vu », café, naïve, Ångström.
Emoji: 😀 👍🏽 🚀 ❤️ 🎉 — dashes – and ellipses … and the euro sign € and the pound sign £.
Whitespace:   three spaces,\ttabs\t\tand
newlines

and trailing spaces\x20\x20\x20
"""
