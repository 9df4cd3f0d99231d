"""Run by test_sglang_frontend.py in a process of its own (importing `sglang` patches
transformers for the whole process): the real `sglang` frontend against the server at
argv[1] (API key argv[2]). SGLang's own frontend test programs whose checks are about shape
and validity run as they are; the rest of its list (few-shot QA, decode_int, parallel
decoding) run here at a small size. Prints one JSON object of what the test checks."""

from __future__ import annotations

import json
import sys


def few_shot_qa(lang):
    """SGLang's few-shot QA program in `lang` (sglang, or ember.lang)."""

    @lang.function
    def qa(s, question):
        s += "The following are questions with answers.\n\n"
        s += "Q: What is the capital of France?\nA: Paris\n"
        s += "Q: What is the capital of Germany?\nA: Berlin\n"
        s += "Q: " + question + "\n"
        s += "A:" + lang.gen("answer", stop="\n", temperature=0, max_tokens=16)
    return qa


def main(url: str, key: str) -> None:
    import sglang as sgl
    from sglang.test import test_programs

    sgl.set_default_backend(sgl.RuntimeEndpoint(url, api_key=key))
    ran = []
    for name in ("test_select", "test_mt_bench", "test_decode_json_regex", "test_regex", "test_dtype_gen",
                 "test_stream"):
        test = getattr(test_programs, name)
        test(False) if name == "test_select" else test()
        ran.append(name)

    questions = [{"question": f"What is the capital of {c}?"} for c in ("Japan", "Spain", "Egypt")]
    answers = [s["answer"] for s in few_shot_qa(sgl).run_batch(questions)]

    @sgl.function
    def decode_int(s):
        s += "The number of hours in a day is " + sgl.gen_int("hours", max_tokens=4) + "\n"
        s += "The number of days in a year is " + sgl.gen_int("days", max_tokens=5) + "\n"

    ints = decode_int.run(temperature=0)

    @sgl.function
    def parallel_decoding(s, topic):
        s += "USER: Give three tips for " + topic + ".\nASSISTANT: Here are three tips:\n"
        for i in range(1, 4):
            s += f"{i}." + sgl.gen(max_tokens=8, stop=[".", "\n"]) + ".\n"
        forks = s.fork(3)
        for i in range(3):
            forks[i] += f"Tip {i + 1} in detail:" + sgl.gen("detail", max_tokens=12, stop=["\n\n"])
        forks.join()
        s += "In summary," + sgl.gen("summary", max_tokens=12)

    tips = parallel_decoding.run(topic="writing", temperature=0)
    print(json.dumps({"ran": ran, "answers": answers, "hours": ints["hours"], "days": ints["days"],
                      "details": tips["detail"], "summary": tips["summary"]}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
