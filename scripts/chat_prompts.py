#!/usr/bin/env python3
"""Write realistic OpenAI chat request bodies, one JSON object a line, for token-count checks.

    python3 scripts/chat_prompts.py OUT.jsonl [--n 80] [--seed 7]

Multi-turn conversations (1 to 4 user turns with the assistant's answers between),
system prompts (most), English prose with capitals, punctuation, numbers and code,
some non-English and emoji, tool definitions (about one in five) and tool calls with
their results (the assistant's tool-call turn has content "": llama-cpp-python's server
refuses null). Prompt sizes range from a few hundred bytes to ~6 KB. The workload
crate's prompt text (pseudo-words of lowercase syllables, made to be 4 bytes per token)
is not used: how many bytes a real tokenizer makes a token of depends on real text.

`crates/gorgo-tokenizer/fixtures/chat-prompts.jsonl` is this script's output with the
defaults; the node's token tests and scripts/tokenizer_check.py send it.
"""
import argparse
import json
import random

SYSTEMS = [
    "You are a helpful assistant. Answer concisely and cite sources when you can.",
    "You are a senior software engineer reviewing code. Be direct, point out bugs first, then style.",
    "You are a travel agent for Europe and Asia. Prices are in EUR unless the user says otherwise.",
    "Tu es un assistant qui répond en français, avec des phrases courtes et précises.",
    "You are a customer-support agent for Acme Cloud. Never share internal ticket IDs. Escalate outages.",
    "You are a math tutor. Show each step, then give the final answer on its own line.",
]

TOPICS = [
    "the difference between TCP and QUIC for long-lived connections",
    "how prefix caching works in vLLM and why block size matters",
    "a 3-day itinerary for Kyoto in November",
    "why my Rust program deadlocks when two tasks lock the same mutex",
    "the best way to store time series in PostgreSQL",
    "how to explain recursion to a 10-year-old",
    "refunds for a double-charged invoice (#INV-20931)",
    "the proof that the square root of 2 is irrational",
    "migrating a Django app from SQLite to MySQL",
    "what causes the northern lights and when to see them in Norway",
]

SENTENCES = [
    "Could you walk me through it step by step?",
    "I tried restarting the service, but the error came back after about 15 minutes.",
    "Here is what I have so far, and I'm not sure it's right.",
    "The budget is around 1,200 EUR for two people, flights not included.",
    "Please keep the answer under 200 words if possible.",
    "We run this on 3 nodes in us-east-1 and eu-west-1, each with 64 GB of RAM.",
    "What would you change first, and why?",
    "My colleague says the opposite; who is right?",
    "The logs show `connection reset by peer` right before the crash.",
    "Also, is there a simpler way to do this without extra dependencies?",
    "I read that the answer depends on the load, but I don't understand how.",
    "Thanks! One more thing: how does this scale to 10x the traffic?",
]

FOREIGN = [
    "Est-ce que c'est possible de réserver un hôtel près de la gare ?",
    "Gibt es eine Möglichkeit, das schneller zu machen? Danke im Voraus!",
    "京都で一番おすすめのお寺はどこですか？",
    "¿Cuánto tiempo se tarda en llegar al aeropuerto en tren?",
    "Это работает на Linux, но не на macOS. Почему?",
    "Great, that worked 🎉 — but now the tests are flaky 😅",
]

CODE = [
    "```rust\nfn main() {\n    let m = std::sync::Mutex::new(0);\n    let a = m.lock().unwrap();\n    let b = m.lock().unwrap(); // hangs here\n    println!(\"{} {}\", a, b);\n}\n```",
    "```python\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])\n```",
    "```sql\nSELECT device_id, date_trunc('hour', ts) AS h, avg(value)\nFROM readings\nWHERE ts > now() - interval '7 days'\nGROUP BY 1, 2\nORDER BY 2 DESC;\n```",
]

ANSWERS = [
    "Sure. First, check whether the two locks are taken on the same thread: a std Mutex is not reentrant, so the second lock() blocks forever. Drop the first guard before taking the second, or restructure so one guard is enough.",
    "In short: QUIC multiplexes streams over UDP, so one lost packet stalls only its stream, while TCP stalls everything behind it. For long-lived connections QUIC also survives address changes (connection migration).",
    "Day 1: Fushimi Inari early in the morning, then Tofuku-ji for the autumn leaves. Day 2: Arashiyama bamboo grove, Tenryu-ji, and the monkey park. Day 3: Kiyomizu-dera, Sannenzaka, and Gion in the evening.",
    "Assume sqrt(2) = p/q in lowest terms. Then p^2 = 2q^2, so p is even: p = 2k. Then 4k^2 = 2q^2, so q^2 = 2k^2 and q is even too, contradicting lowest terms.",
    "I'm sorry about the double charge. I've opened a refund request for the duplicate payment; it usually takes 5-7 business days to appear on your statement.",
]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name, e.g. Oslo"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "search_flights", "description": "Search flights between two airports on a date.",
        "parameters": {"type": "object", "properties": {"from": {"type": "string"}, "to": {"type": "string"},
            "date": {"type": "string", "description": "YYYY-MM-DD"}}, "required": ["from", "to", "date"]}}},
    {"type": "function", "function": {"name": "lookup_invoice", "description": "Fetch an invoice by number.",
        "parameters": {"type": "object", "properties": {"number": {"type": "string"}}, "required": ["number"]}}},
]


def user_text(rng):
    parts = [f"I have a question about {rng.choice(TOPICS)}."]
    for _ in range(rng.randint(1, 5)):
        parts.append(rng.choice(SENTENCES))
    if rng.random() < 0.25:
        parts.append(rng.choice(FOREIGN))
    if rng.random() < 0.25:
        parts.append(rng.choice(CODE))
    if rng.random() < 0.3:
        # A pasted document: several paragraphs.
        parts.append("\n\n".join(" ".join(rng.choice(SENTENCES) for _ in range(rng.randint(3, 8)))
                                 for _ in range(rng.randint(1, 4))))
    return " ".join(parts)


def conversation(rng):
    messages = []
    if rng.random() < 0.8:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    body = {"model": "m", "max_tokens": 8}
    with_tools = rng.random() < 0.2
    if with_tools:
        body["tools"] = rng.sample(TOOLS, rng.randint(1, len(TOOLS)))
    turns = rng.randint(1, 4)
    for t in range(turns):
        messages.append({"role": "user", "content": user_text(rng)})
        if t == turns - 1:
            break
        if with_tools and rng.random() < 0.5:
            tool = body["tools"][0]["function"]
            args = {k: "Oslo" if k == "city" else "2026-11-03" if k == "date" else "ARN"
                    for k in tool["parameters"]["required"]}
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": f"call_{t}", "type": "function", "function": {"name": tool["name"], "arguments": json.dumps(args)}}]})
            messages.append({"role": "tool", "tool_call_id": f"call_{t}",
                             "content": json.dumps({"result": "ok", "value": rng.randint(1, 999)})})
        messages.append({"role": "assistant", "content": rng.choice(ANSWERS)})
    body["messages"] = messages
    return body


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=80)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    with open(a.out, "w", encoding="utf-8") as f:
        for _ in range(a.n):
            f.write(json.dumps(conversation(rng), ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
