"""The prompts behind the SmolLM2 golden files: chat and plain, short and long (>= 400 tokens),
code, digits, non-English. Written for this project."""

from __future__ import annotations

LONG_ESSAY = """\
The history of computing is often told as a story of machines, but it is just as much a story \
of people who learned to describe problems precisely. Long before electronic computers existed, \
clerks in insurance offices and observatories followed written procedures to produce tables of \
numbers. These procedures had to be unambiguous, because the people following them were not \
expected to understand the mathematics behind each step. When the first programmable machines \
appeared in the middle of the twentieth century, the same discipline carried over: a program \
was a procedure so exact that a machine could follow it without judgment.

Early machines were enormous, slow by modern standards, and difficult to program. Instructions \
were entered with switches, plugboards, or punched cards, and a single mistake could waste a day \
of work. Engineers soon realized that the hardest part of using a computer was not building it \
but telling it what to do. This realization led to assemblers, then to higher level languages, \
and eventually to operating systems that allowed many programs to share one machine.

As hardware became cheaper, computers moved from laboratories into offices, then into homes, \
and finally into pockets. Each step changed who could use a computer and what they expected it \
to do. A scientist in the nineteen fifties wanted answers to equations; a bank in the nineteen \
seventies wanted reliable records; a family in the nineteen nineties wanted games, letters, and \
a connection to the wider world. Today a person expects a device to understand speech, recognize \
faces, translate languages, and answer questions in ordinary sentences.

Through all of these changes, one idea has remained constant. A computer does exactly what it is \
told, and the art of computing lies in telling it the right thing. Programming languages, \
libraries, and tools have made that art easier, but they have not removed the need for careful \
thought. Every system that seems intelligent is built on layers of precise instructions written \
by people who had to imagine every case the system might face. Understanding those layers, and \
the people who built them, is the best way to understand what computers can and cannot do.

Summarize the passage above in three sentences."""

LONG_CODE = '''\
import heapq
from dataclasses import dataclass, field


@dataclass(order=True)
class Task:
    priority: int
    name: str = field(compare=False)
    duration: float = field(compare=False, default=1.0)


class Scheduler:
    """Runs tasks in priority order and records when each one finished."""

    def __init__(self):
        self._queue = []
        self._clock = 0.0
        self.finished = {}

    def submit(self, task):
        if task.duration <= 0:
            raise ValueError(f"task {task.name} must take positive time")
        heapq.heappush(self._queue, task)

    def run(self, limit=None):
        count = 0
        while self._queue and (limit is None or count < limit):
            task = heapq.heappop(self._queue)
            self._clock += task.duration
            self.finished[task.name] = self._clock
            count += 1
        return count

    def pending(self):
        return sorted(task.name for task in self._queue)


def build_default_scheduler():
    scheduler = Scheduler()
    for index, name in enumerate(["parse", "plan", "compile", "link", "test", "deploy"]):
        scheduler.submit(Task(priority=index % 3, name=name, duration=1.5 + index))
    return scheduler


def report(scheduler):
    lines = []
    for name, finished_at in sorted(scheduler.finished.items(), key=lambda item: item[1]):
        lines.append(f"{name:>10}: finished at t={finished_at:6.2f}")
    return "\\n".join(lines)


if __name__ == "__main__":
    scheduler = build_default_scheduler()
    scheduler.run(limit=4)
    print(report(scheduler))
    print("still pending:", scheduler.pending())


def test_scheduler_orders_by_priority():
    scheduler = Scheduler()
'''

# (name, kind, content): kind "chat" gives a list of messages, "plain" a string.
PROMPTS: list[tuple[str, str, object]] = [
    ("chat_capital", "chat", [{"role": "user", "content": "What is the capital of France?"}]),
    ("chat_prime_code", "chat", [{"role": "user", "content":
                                  "Write a Python function that checks whether a number is prime."}]),
    ("chat_long_essay", "chat", [{"role": "system", "content": "You are a concise assistant."},
                                 {"role": "user", "content": LONG_ESSAY}]),
    ("chat_multi_turn", "chat", [{"role": "user", "content": "Name three colors."},
                                 {"role": "assistant", "content": "Red, green and blue."},
                                 {"role": "user", "content": "Which of them is the sky?"}]),
    ("chat_german", "chat", [{"role": "user", "content":
                              "Erkläre mir bitte, wie ein Regenbogen entsteht."}]),
    ("plain_capital", "plain", "The capital of France is"),
    ("plain_code_fib", "plain", "def fibonacci(n):\n    "),
    ("plain_primes", "plain", "Here are the first prime numbers: 2, 3, 5, 7, 11, 13,"),
    ("plain_arith", "plain", "1 + 1 = 2\n2 + 2 = 4\n3 + 3 = 6\n12 + 30 ="),
    ("plain_french", "plain", "La capitale de la France est"),
    ("plain_japanese", "plain", "東京は日本の首都であり、"),
    ("plain_long_code", "plain", LONG_CODE),
    ("plain_long_essay", "plain", LONG_ESSAY),
    ("plain_emoji", "plain", "My favourite emoji are 😀 and 🚀 because"),
]

# Strings whose token ids are pinned against llama.cpp's tokenizer.
TOKENIZER_STRINGS = [
    "Hello world", " Hello world", "Hello  world", "   leading spaces", "trailing spaces   ",
    "tabs\tand\nnewlines\n\n\n", "  \n2", "x  \n  42", "3.14159 and 2718281828", "a1b2c3 99 bottles",
    "héllo wörld, ça va?", "東京は日本の首都です。", "Привет, мир!", "مرحبا بالعالم",
    "emoji 😀🚀👍🏽 here", "def f(x):\n    return x ** 2  # square\n",
    "if (a != b && c >= 10) { return; }", "<|im_start|>user\nhi<|im_end|>\n",
    "text<|endoftext|>more", "don't can't I'm we'll they've", "ALLCAPS and MiXeD CaSe",
    "https://example.com/path?query=1&x=2", "   ", "\n", "a",
]

CHAT_CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."},
     {"role": "user", "content": "Another one, with émojis 🍐?"}],
]
