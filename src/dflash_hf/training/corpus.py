"""A large prompt corpus built offline and deterministically, kept away from the evaluation sets.

Sources (each a *part* with its own answer shards, see `corpus_shards`):
- `mined`: instructions built from docstrings, code and comments of installed Python sources (the standard library and
  pinned site-packages), each in a few phrasings (implement, explain, document, write tests, refactor, review...).
  Their text belongs to those packages, so it is rebuilt here from the installed versions and never committed.
- `topics`: our own question templates over seed topics.
- `tasks`: our own task templates over the same topics: writing in a form or a voice, role-play, word problems, plans,
  comparisons (the kinds of request a chat assistant gets beyond questions).
- `studies`: our own templates over the same topics for science, reasoning, structured extraction and humanities.
- `written`: questions the target wrote itself from seed topics (committed, since the target wrote them).
- `derived-<part>`: follow-up turns, rewrites and summaries over the answers of an earlier shard.
Every prompt passes `EvalOverlap`, which rejects anything matching MT-Bench or HumanEval text or function names.
"""

import ast
import importlib.metadata
import importlib.util
import re
import sysconfig
import zlib
from pathlib import Path

from .data import SEED_TOPICS
from .eval_overlap import EvalOverlap

# Import name -> distribution name (for the recorded versions). The standard library is `stdlib` (Python's version).
MINED_PACKAGES = {
    "stdlib": "python", "numpy": "numpy", "torch": "torch", "transformers": "transformers", "sympy": "sympy",
    "networkx": "networkx", "jinja2": "jinja2", "fsspec": "fsspec", "huggingface_hub": "huggingface_hub",
    "accelerate": "accelerate", "matplotlib": "matplotlib", "pandas": "pandas", "hypothesis": "hypothesis",
    "_pytest": "pytest", "tqdm": "tqdm", "PIL": "pillow", "pydantic": "pydantic", "httpx": "httpx",
}
MIN_DOC_CHARS, MAX_DOC_CHARS = 40, 800
MAX_SOURCE_LINES, MAX_SOURCE_CHARS = 30, 1400
TEMPLATES_PER_ITEM = 2  # phrasings drawn per documented object: variety without repeating one object too often
COMMENTS_PER_FILE = 2

FUNCTION_TEMPLATES = {
    "implement": "Write a Python function `{name}{signature}` that does the following:\n\n{doc}",
    "stub": "Implement the function below and answer with all of it in a Python code block.\n\n```python\n"
            "def {name}{signature}:\n    \"\"\"{indented_doc}\n    \"\"\"\n```",
    "tests": "Write pytest unit tests for a Python function `{name}{signature}` documented as follows:\n\n{doc}",
    "explain-doc": "Explain in plain words what a function documented like this does, and when you would use "
                   "it:\n\n{doc}",
    "example": "Show a short example of calling a Python function `{name}{signature}` that is documented as "
               "follows, and explain the result:\n\n{doc}",
}
SOURCE_TEMPLATES = {
    "explain": "Explain what this Python code does, step by step:\n\n```python\n{source}\n```",
    "refactor": "Refactor this Python code to make it easier to read, and explain your changes:\n\n```python\n"
                "{source}\n```",
    "document": "Write a clear docstring for this Python function:\n\n```python\n{bare_source}\n```",
    "review": "Review this Python code and point out possible bugs or improvements:\n\n```python\n{source}\n```",
}
CLASS_TEMPLATES = {
    "class": "Write a Python class `{name}` that matches this description:\n\n{doc}",
    "explain-class": "Explain the purpose of a class described like this, and give an example of using it:\n\n{doc}",
}
MODULE_TEMPLATES = {
    "summarize-module": "Summarize this documentation of a Python module in a few bullet points:\n\n{doc}",
    "module-questions": "Here is the documentation of a Python module. What are three questions a new user might "
                        "ask about it, and their answers?\n\n{doc}",
}
COMMENT_TEMPLATES = {
    "comment-code": "Write Python code that does what this comment describes:\n\n{comment}",
    "comment-explain": "A programmer left this comment in their code. Explain what it means:\n\n{comment}",
}

MORE_TOPICS = (
    "the Great Wall of China", "the Renaissance", "the Industrial Revolution", "the Cold War", "ancient Greece",
    "the Silk Road", "the Vikings", "the Aztecs", "medieval castles", "the history of medicine", "electricity",
    "magnets", "gravity", "light and color", "sound waves", "atoms", "chemical reactions", "the periodic table",
    "acids and bases", "the weather", "hurricanes", "glaciers", "rivers", "soil", "bees", "ants", "whales", "sharks",
    "elephants", "penguins", "wolves", "butterflies", "mushrooms", "trees", "flowers", "the human brain", "muscles",
    "bones", "digestion", "hydration", "stress", "meditation", "first aid", "cooking rice", "making soup", "coffee",
    "tea", "chocolate", "cheese", "spices", "vegetarian cooking", "meal planning", "kitchen safety", "cleaning a home",
    "moving to a new city", "renting an apartment", "buying a used car", "budgeting", "credit cards", "taxes",
    "retirement savings", "starting a business", "customer service", "teamwork", "leadership", "negotiation",
    "giving feedback", "remote work", "meetings", "project management", "writing clear emails", "note taking",
    "reading habits", "libraries", "museums", "architecture", "sculpture", "dance", "theater", "jazz", "opera",
    "comics", "animation", "podcasts", "journalism", "advertising", "social media", "online privacy", "encryption",
    "computer networks", "operating systems", "compilers", "version control with git", "unit testing", "debugging",
    "APIs", "cloud computing", "data structures", "hash tables", "linked lists", "binary search", "graphs",
    "regular expressions", "SQL", "HTML", "CSS", "Rust", "C programming", "object-oriented programming",
    "functional programming", "software design", "open source", "robots", "3D printing", "satellites", "Mars",
    "stars", "comets", "telescopes", "the speed of light", "time zones", "calendars", "maps", "compasses",
    "sailing", "hiking", "swimming", "soccer", "basketball", "tennis", "the Olympic Games", "marathons",
    "knitting", "woodworking", "pottery", "birdwatching", "astronomy as a hobby", "volunteering", "recycling at home",
    "composting", "electric bikes", "public transport", "cities of the future", "farming", "irrigation",
    "fishing", "bread yeast", "fermentation", "logic puzzles", "algebra", "calculus", "percentages", "averages",
    "graphs and charts", "counting and combinatorics", "the number zero", "infinity", "clocks", "languages of the world",
    "grammar", "punctuation", "synonyms", "etymology", "sign language", "translation", "writing a cover letter",
    "a first day at a new job", "learning to cook", "moving abroad", "kindness", "curiosity", "habits", "motivation",
)
TOPICS = tuple(dict.fromkeys(SEED_TOPICS + MORE_TOPICS))
TOPIC_TEMPLATES = (
    "What is {topic}? Explain it simply.",
    "Give me five interesting facts about {topic}.",
    "Write a short poem about {topic}.",
    "What are common misconceptions about {topic}?",
    "Explain {topic} to a ten-year-old.",
    "Write the opening paragraph of a blog post about {topic}.",
    "What are the main advantages and disadvantages related to {topic}?",
    "Make a four-week study plan for learning about {topic}.",
    "Write a very short story in which {topic} plays a role.",
    "Summarize the history of {topic} in one paragraph.",
    "List three questions a student might ask about {topic}, and answer each.",
    "Write a haiku about {topic}.",
    "Write a dialogue between a teacher and a student about {topic}.",
    "Describe {topic} in one paragraph, as an encyclopedia would.",
    "What are the most important terms to know about {topic}? Define each briefly.",
    "Write a multiple-choice quiz question about {topic}, with the answer.",
    "Explain {topic} using an everyday analogy.",
    "Write a friendly email recommending that a friend learn about {topic}.",
    "What jobs or careers are connected to {topic}?",
    "Give step-by-step advice to a beginner who is interested in {topic}.",
    "Write a product description for a book about {topic}.",
    "What is one surprising thing about {topic}?",
    "Write a list of do's and don'ts about {topic}.",
    "How has {topic} changed over the last hundred years?",
)

# Tasks rather than questions: a form to write in, a voice to take, a problem to set and solve. Like the topic
# templates, frozen once answered: the committed shards hold answers to exactly these; new kinds need a new part.
TASK_TEMPLATES = (
    "Write a persuasive paragraph arguing that everyone should know something about {topic}.",
    "You are a museum guide. Tell a group of visitors about {topic}.",
    "Pretend to be a journalist interviewing an expert on {topic}: write three questions and the expert's answers.",
    "Write a short speech for a school assembly about {topic}.",
    "Compare {topic} with a closely related subject in a small table, then sum up the difference in one sentence.",
    "Write a limerick about {topic}.",
    "Write a letter to a local newspaper explaining why {topic} matters to your town.",
    "Make up a riddle whose answer has to do with {topic}, then explain the answer.",
    "Make up a math word problem about {topic} and solve it step by step.",
    "Write a diary entry by someone whose work has to do with {topic}.",
    "Outline a five-minute presentation about {topic}.",
    "Announce a new discovery about {topic} in two sentences, as a news headline and a lead.",
    "Review an imaginary documentary film about {topic}.",
    "Talk about {topic} in the voice of a pirate captain.",
    "Write numbered instructions for someone starting a hobby connected to {topic}.",
    "Describe a typical working day of a person who studies {topic}.",
    "Write a short advertisement for a weekend workshop on {topic}.",
    "Suggest five creative project ideas for a class studying {topic}.",
    "Write a fable that teaches a lesson about {topic}.",
    "What would change in the world if {topic} suddenly disappeared?",
    "Write a FAQ section with three questions and answers about {topic}.",
    "Give the strongest argument for and the strongest argument against spending more public money on {topic}.",
    "Write a thank-you note to a teacher who made {topic} interesting for you.",
    "Plan the chapters of a beginner's book about {topic}, one line each.",
)

# Requests of the kinds MT-Bench's first turns were weakest on for the shipped draft (science and engineering,
# reasoning, structured extraction, humanities), in our own words over the same topics. Frozen once answered, like the
# others.
STUDY_TEMPLATES = (
    "Explain the science behind {topic}: what happens, and why does it happen?",
    "Which physical, chemical or biological processes play a part in {topic}? Describe each in a few sentences.",
    "Design a simple experiment a student could run to learn something about {topic}. What would they measure, and "
    "what result would they expect?",
    "Explain {topic} to a university student, using the precise technical terms and defining each one.",
    "Which problems in engineering or medicine has {topic} helped to solve? Give two examples.",
    "Is there a formula, a law or a rule of thumb that describes part of {topic}? State it and explain each term.",
    "Invent a logic puzzle about {topic} that has exactly one solution, then solve it, showing every step.",
    "Someone says that {topic} does not matter at all. Reason step by step about whether they are right.",
    "Estimate roughly how many people in a city of one million have something to do with {topic} each day. Show "
    "each assumption and each multiplication.",
    "Name three things that can go wrong with {topic}, and reason out the most likely cause of each.",
    "Write four true-or-false statements about {topic}, then give the right answer to each with a reason.",
    "What came first, what came later and what came last in the development of {topic}? Explain the order.",
    "Write a short paragraph about {topic}, then list every name, place, date and number in it as a JSON object.",
    "Give a small table of key facts about {topic} in CSV format, starting with a header row.",
    "Describe {topic} as a YAML record with the fields name, field_of_study, summary and related_subjects.",
    "List five terms connected to {topic} as a JSON array of objects with the keys \"term\" and \"meaning\".",
    "Name four aspects of {topic} and sort each into one of the groups science, history, culture or daily life. "
    "Explain each choice in one line.",
    "On a scale from 1 to 10, how hard is {topic} to learn for a child, a teenager and an adult? Answer as a JSON "
    "object with a score and a reason for each.",
    "How has {topic} shaped the culture and society of different countries?",
    "Which ethical questions does {topic} raise? Discuss two of them from both sides.",
    "How might a philosopher such as Aristotle or Confucius have thought about {topic}?",
    "What are the effects of {topic} on the budgets of ordinary households and on the wider economy?",
    "Which customs or manners around {topic} differ from one country to another? Give examples.",
    "Recommend three books or films that would help someone understand {topic}, and say what each one offers.",
)

DERIVED_FOLLOW_UPS = (
    "Can you give a concrete example?", "Please explain that more simply.", "Can you make that shorter?",
    "What are common mistakes people make with this?", "Can you put that in a table or a list?",
    "Why is that important?", "What should I learn next?", "Thanks! Can you summarize it in one sentence?",
)
DERIVED_TEMPLATES = {
    "rewrite-formal": "Rewrite the following text in a more formal style:\n\n{answer}",
    "rewrite-simple": "Rewrite the following text so that a child could understand it:\n\n{answer}",
    "summary": "Summarize the following text in two sentences:\n\n{answer}",
    "bullets": "Turn the following text into a short bulleted list of its key points:\n\n{answer}",
    "title": "Suggest a good title for the following text, and explain your choice:\n\n{answer}",
}
DERIVED_EVERY = 3  # about one answer in three gets a derived prompt
DERIVED_MIN_ANSWER_TOKENS = 40


def stable_hash(text: str) -> int:
    """A hash that is the same on every machine and Python run (unlike `hash`)."""
    return zlib.crc32(text.encode())


def pick(options, key: str, count: int = 1) -> list:
    """`count` of `options` chosen by `key` alone: the same choice everywhere, different across keys."""
    options = sorted(options)
    ranked = sorted(options, key=lambda option: stable_hash(f"{key}|{option}"))
    return ranked[:count]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ----------------------------------------------------------------------------------------------------------------------
# Mined: installed Python sources
# ----------------------------------------------------------------------------------------------------------------------


def package_root(name: str) -> Path | None:
    if name == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    spec = importlib.util.find_spec(name)
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def package_versions(packages=MINED_PACKAGES) -> dict[str, str | None]:
    """The version of every mined distribution (None: not installed, so it adds nothing)."""
    import platform

    versions = {}
    for name, dist in packages.items():
        if name == "stdlib":
            versions["python"] = platform.python_version()
            continue
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def _source_files(root: Path, stdlib: bool) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if "test" in relative or (stdlib and relative.split("/")[0] in ("site-packages", "dist-packages", "idlelib",
                                                                         "lib2to3", "turtledemo")):
            continue
        files.append(path)
    return files


def _clip_doc(doc: str) -> str:
    """The first paragraphs of a docstring, up to MAX_DOC_CHARS."""
    if len(doc) <= MAX_DOC_CHARS:
        return doc
    cut = doc.rfind("\n\n", 0, MAX_DOC_CHARS)
    return doc[: cut if cut >= MIN_DOC_CHARS else MAX_DOC_CHARS].rstrip()


def _signature(node) -> str:
    text = ast.unparse(node.args)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"({text}){returns}"


def _bare_source(lines: list[str], node) -> str:
    """The function's source without its docstring (for the `document` phrasing)."""
    doc_node = node.body[0]
    kept = lines[node.lineno - 1 : doc_node.lineno - 1] + lines[doc_node.end_lineno : node.end_lineno]
    return "\n".join(kept)


def _file_items(package: str, relative: str, text: str, seen: set[str]) -> list[dict]:
    """Every mined prompt of one source file."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    base = f"mined:{package}:{relative}"
    items = []

    def add(key: str, templates: dict, fields: dict, dedup: str, name: str | None = None):
        dedup_key = re.sub(r"\s+", " ", dedup)[:400]
        if dedup_key in seen:
            return  # the same text under another name (copied code, re-exports): one is enough
        seen.add(dedup_key)
        for style in pick(templates, f"{base}:{key}", TEMPLATES_PER_ITEM):
            items.append({"id": f"{base}:{key}:{style}", "source": f"mined:{style}", "function": name, "mined": True,
                          "messages": user(templates[style].format(**fields))})

    module_doc = ast.get_docstring(tree)
    if module_doc and len(module_doc) >= 2 * MIN_DOC_CHARS:
        add("<module>", MODULE_TEMPLATES, {"doc": _clip_doc(module_doc)}, module_doc)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < MIN_DOC_CHARS:
            continue
        clipped = _clip_doc(doc)
        if isinstance(node, ast.ClassDef):
            add(node.name, CLASS_TEMPLATES, {"name": node.name, "doc": clipped}, doc, node.name)
            continue
        fields = {"name": node.name, "signature": _signature(node), "doc": clipped,
                  "indented_doc": clipped.replace("\n", "\n    ")}
        source_lines = lines[node.lineno - 1 : node.end_lineno]
        source = "\n".join(source_lines)
        if len(source_lines) <= MAX_SOURCE_LINES and len(source) <= MAX_SOURCE_CHARS and node.col_offset == 0:
            # Short top-level functions: their code too, to explain, refactor, document or review.
            fields.update(source=source, bare_source=_bare_source(lines, node))
            add(f"{node.name}@{node.lineno}", {**FUNCTION_TEMPLATES, **SOURCE_TEMPLATES}, fields, doc, node.name)
        else:
            add(f"{node.name}@{node.lineno}", FUNCTION_TEMPLATES, fields, doc, node.name)
    items.extend(_comment_items(base, lines, seen))
    return items


def _comment_items(base: str, lines: list[str], seen: set[str]) -> list[dict]:
    """Prompts from blocks of at least three comment lines (licence headers and tool pragmas left out)."""
    blocks, current = [], []
    for number, line in enumerate(lines + [""]):
        stripped = line.strip()
        if stripped.startswith("#") and not stripped.startswith("#!"):
            current.append((number, stripped.lstrip("#").strip()))
            continue
        if len(current) >= 3:
            blocks.append(current)
        current = []
    items = []
    for block in blocks:
        comment = "\n".join(text for _, text in block).strip()
        lowered = comment.lower()
        if (len(comment) < 80 or len(comment) > MAX_DOC_CHARS or "licen" in lowered or "copyright" in lowered
                or "noqa" in lowered or "type:" in lowered):
            continue
        key = re.sub(r"\s+", " ", comment)[:400]
        if key in seen:
            continue
        seen.add(key)
        item_id = f"{base}:#{block[0][0] + 1}"
        style = pick(COMMENT_TEMPLATES, item_id)[0]
        items.append({"id": f"{item_id}:{style}", "source": f"mined:{style}", "function": None, "mined": True,
                      "messages": user(COMMENT_TEMPLATES[style].format(comment=comment))})
        if sum(item["id"].startswith(base + ":#") for item in items) >= COMMENTS_PER_FILE:
            break
    return items


def mined_items(packages=tuple(MINED_PACKAGES)) -> list[dict]:
    """Prompts from the installed sources of `packages`, in a fixed order (packages, then files, sorted)."""
    items, seen = [], set()
    for package in packages:
        root = package_root(package)
        if root is None:
            continue
        for path in _source_files(root, package == "stdlib"):
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            items.extend(_file_items(package, path.relative_to(root).as_posix(), text, seen))
    return items


# ----------------------------------------------------------------------------------------------------------------------
# Our templates, the target's own questions, and prompts derived from answers
# ----------------------------------------------------------------------------------------------------------------------


def _template_items(kind: str, templates, topics) -> list[dict]:
    """Every template over every topic, with ids `<kind>:<topic>:<template number>`."""
    return [{"id": f"{kind}:{topic}:{number}", "source": f"{kind}-template", "function": None, "mined": False,
             "messages": user(template.format(topic=topic))}
            for topic in topics for number, template in enumerate(templates)]


def topic_items(topics=TOPICS) -> list[dict]:
    return _template_items("topic", TOPIC_TEMPLATES, topics)


def task_items(topics=TOPICS) -> list[dict]:
    return _template_items("task", TASK_TEMPLATES, topics)


def study_items(topics=TOPICS) -> list[dict]:
    return _template_items("study", STUDY_TEMPLATES, topics)


def written_items(records: list[dict]) -> list[dict]:
    """The target's own questions (records of `data.write_topic_prompts`)."""
    return [{"id": f"written:{r['id']}", "source": "self-written", "function": None, "mined": False,
             "messages": user(r["prompt"])} for r in records]


def derived_item(parent: dict, answer_text: str, answer_tokens: int, finished: bool) -> dict | None:
    """A follow-up turn, rewrite or summary of one answer: for about one answer in `DERIVED_EVERY` that is complete and
    long enough to work on, else None. Follow-ups keep the parent's conversation; the others quote only the answer."""
    key = parent["id"]
    if stable_hash(key + "|derived") % DERIVED_EVERY or not finished or answer_tokens < DERIVED_MIN_ANSWER_TOKENS:
        return None
    kind = pick(("follow-up",) + tuple(DERIVED_TEMPLATES), key)[0]
    if kind == "follow-up":
        messages = parent["messages"] + [{"role": "assistant", "content": answer_text},
                                         {"role": "user", "content": pick(DERIVED_FOLLOW_UPS, key)[0]}]
    else:
        messages = user(DERIVED_TEMPLATES[kind].format(answer=answer_text.strip()))
    return {"id": f"derived:{key}:{kind}", "source": f"derived:{kind}", "function": None, "messages": messages,
            "mined": parent["mined"] and kind == "follow-up"}


def finalize(items: list[dict], overlap: EvalOverlap, stats: dict | None = None) -> list[dict]:
    """The items that pass the evaluation-overlap check (each says whether it holds `mined` text, not to commit)."""
    kept = []
    for item in items:
        text = "\n".join(message["content"] for message in item["messages"] if message["role"] == "user")
        if overlap.reason(text, item.get("function")) is not None:
            if stats is not None:
                stats["rejected"] = stats.get("rejected", 0) + 1
            continue
        kept.append(item)
    return kept
