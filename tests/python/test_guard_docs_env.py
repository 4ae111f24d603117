"""Guards that keep the README short, its links whole, and the environment in the registry.

Cheap: they read files and nothing else (no build, no subprocess, no device).
Each guard is a function over a folder or a text that returns its
violations; the tests run it over this checkout, and feed it a synthetic
violation to show it is caught.

What counts as reading the environment (decided here, once):
- Reads: ``os.environ.get``/``pop``/``[...]`` loaded, ``in os.environ``,
  iterating it, ``os.getenv``, ``os.environ`` handed to anything but a
  whole-environment copy; in C++, ``getenv``/``secure_getenv`` and ``environ``.
- Writes are not reads: ``os.environ[...] = ...``, ``del os.environ[...]``,
  ``os.environ.update``/``clear``.
- ``os.environ.setdefault(...)`` as a statement of its own is a write: the
  package never looks at the value, it only sets another program's flag
  unless the user already has (torch_tpu/vllm/platform.py sets vLLM's
  worker start method so). A setdefault whose result is used reads the
  variable, and is a violation.
- A whole-environment copy for a child process (``dict(os.environ)``,
  ``os.environ.copy()``, ``{**os.environ}``, ``env=os.environ``) reads no
  variable by name: allowed.
The names checked against the registry are the ones written out at a read;
a name passed on in a variable (process_span.cpp's envInt(name)) is checked
when it is read, by the registry itself (tpu::env::find throws, and
torch_tpu._env.get raises KeyError, for an undeclared name).
"""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README_LIMIT = 200
# The package: what users run. Only the registry modules may read the environment.
PACKAGE = ("csrc", "torch_tpu")
REGISTRY_MODULES = ("csrc/runtime/env.cpp", "torch_tpu/_env.py")
REGISTRY = "csrc/runtime/env.cpp"
CPP_SUFFIXES = (".cpp", ".cc", ".c", ".h", ".hpp", ".cu", ".cuh")
# Where the project's own names may appear outside the package (scripts read
# TORCH_TPU_TEST_FUSED, tests set TORCH_TPU_PLUGIN).
ELSEWHERE = ("tools", "scripts", "benchmarks", "tests", ".ci", "examples", "setup.py")
# Our prefixes, as any text spells them; TPU_ alone also names C++ macros
# (TPU_HOST_SIMD), so a TPU_ name counts outside the package where it is quoted or
# is a shell variable.
OURS = re.compile(r"\b(TORCH_TPU_[A-Z0-9_]+|VLLM_TPU_[A-Z0-9_]+|VLLM_TORCH_TPU[A-Z0-9_]*)\b")
OURS_TPU = re.compile(r"""(?:["']|\$\{?)(TPU_[A-Z0-9_]+)\b|(?:^|[\s"'])(TPU_[A-Z0-9_]+)=""", re.M)
NAME = r"([A-Za-z_][A-Za-z0-9_]*)"
# Reads through the registry, with the name written out.
CPP_REGISTRY_READ = re.compile(r"\benv::(?:get|enabled|notDisabled|positiveInt|bytes|list|find)\(\s*\"" + NAME + '"')
PY_REGISTRY_READ = re.compile(r"\b_env\.(?:get|declared)\(\s*[\"']" + NAME + "[\"']")


def _files(root, folders, suffixes):
    for folder in folders:
        top = os.path.join(root, folder)
        if os.path.isfile(top):
            yield top
        for dirpath, _, files in os.walk(top):
            for f in sorted(files):
                if f.endswith(suffixes):
                    yield os.path.join(dirpath, f)


def _rel(root, path):
    return os.path.relpath(path, root).replace(os.sep, "/")


# ---- README length ----


def readme_violations(text: str, limit: int = README_LIMIT) -> list[str]:
    n = len(text.splitlines())
    if n <= limit:
        return []
    return [f"README.md has {n} lines, over the limit of {limit}: it is for users (what this is, the two "
            "commands, quick start, the modes, each capability in a few lines); move the detail to the docs/ "
            "page where it belongs and link it"]


# ---- links ----


def broken_links(root: str, files) -> list[str]:
    """Relative Markdown links in `files` (paths under root) whose target is not a file or folder
    (code blocks skipped; web links and anchors within the page not checked)."""
    out = []
    for rel in files:
        path = os.path.join(root, rel)
        text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1).split("#")[0]
            if target and not re.match(r"[a-z]+:", target) and \
                    not os.path.exists(os.path.join(os.path.dirname(path), target)):
                out.append(f"{rel}: ({m.group(1)})")
    return out


def _doc_pages(root):
    return ["README.md"] + sorted("docs/" + f for f in os.listdir(os.path.join(root, "docs")) if f.endswith(".md"))


# ---- raw environment reads ----


def _blank_cpp(text: str) -> str:
    """The C++ text with comments and string and character literals blanked
    (newlines kept, so line numbers hold)."""
    out, i, n = [], 0, len(text)

    def blank(s):
        return re.sub(r"[^\n]", " ", s)

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
        else:
            out.append(c)
            i += 1
            continue
        out.append(blank(text[i:j]))
        i = j
    return "".join(out)


CPP_RAW_READ = re.compile(r"\b(?:secure_getenv|getenv|getenv_s|environ)\b")


def cpp_raw_reads(text: str) -> list[tuple[int, str]]:
    """(line, source line) of each environment read in C++ source."""
    if not CPP_RAW_READ.search(text):
        return []  # the common case, without blanking the file
    lines = text.splitlines()
    found = []
    for no, line in enumerate(_blank_cpp(text).splitlines(), 1):
        if CPP_RAW_READ.search(line):
            found.append((no, lines[no - 1].strip()))
    return found


def _is_os_attr(node, attr):
    return (isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name)
            and node.value.id == "os")


def python_raw_reads(text: str) -> list[tuple[int, str]]:
    """(line, source line) of each environment read in Python source, by the rules in this module's
    docstring."""
    return sorted({(no, line) for no, line, _ in _python_reads(text)})


def _literal(node):
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _python_reads(text: str) -> list[tuple[int, str, str | None]]:
    """(line, source line, the variable's name where written out) of each read."""
    if "environ" not in text and "getenv" not in text:
        return []
    tree = ast.parse(text)
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    lines = text.splitlines()
    found = []

    def add(node, name=None):
        found.append((node.lineno, lines[node.lineno - 1].strip(), name))

    # Names bound to os's environment or getenv by `from os import ...`.
    env_names, getenv_names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            for a in node.names:
                if a.name in ("environ", "environb"):
                    env_names.add(a.asname or a.name)
                    add(node)
                elif a.name == "getenv":
                    getenv_names.add(a.asname or a.name)
                    add(node)

    for node in ast.walk(tree):
        if _is_os_attr(node, "getenv") or (isinstance(node, ast.Name) and node.id in getenv_names
                                           and isinstance(node.ctx, ast.Load)):
            call = parents.get(node)
            add(node, _literal(call.args[0]) if isinstance(call, ast.Call) and call.args else None)
            continue
        is_env = _is_os_attr(node, "environ") or _is_os_attr(node, "environb") or (
            isinstance(node, ast.Name) and node.id in env_names and isinstance(node.ctx, ast.Load))
        if not is_env:
            continue
        parent = parents.get(node)
        name = None
        if isinstance(parent, ast.Subscript) and parent.value is node:
            if isinstance(parent.ctx, (ast.Store, ast.Del)):
                continue  # os.environ[X] = ..., del os.environ[X]: writes
            name = _literal(parent.slice)
        elif isinstance(parent, ast.Attribute) and parent.value is node:
            if parent.attr in ("update", "clear", "copy"):
                continue  # writes, or a whole-environment copy
            if parent.attr == "setdefault" and isinstance(parents.get(parents.get(parent)), ast.Expr):
                continue  # a setdefault as a statement: sets another program's flag, reads nothing back
            call = parents.get(parent)
            if isinstance(call, ast.Call) and call.func is parent and call.args:
                name = _literal(call.args[0])
        elif isinstance(parent, ast.Compare) and node in parent.comparators:
            name = _literal(parent.left)
        elif isinstance(parent, ast.Call) and node in parent.args and isinstance(parent.func, ast.Name) \
                and parent.func.id == "dict" and len(parent.args) == 1:
            continue  # dict(os.environ): a whole-environment copy
        elif isinstance(parent, ast.keyword) and parent.arg == "env":
            continue  # env=os.environ: the whole environment for a child process
        elif isinstance(parent, ast.Dict) and node in parent.values and \
                parent.keys[parent.values.index(node)] is None:
            continue  # {**os.environ, ...}: a whole-environment copy
        add(node, name)
    return found


def raw_env_reads(root: str) -> list[str]:
    """Every environment read in the package (csrc/, torch_tpu/) outside the registry modules."""
    out = []
    for path in _files(root, PACKAGE, CPP_SUFFIXES + (".py",)):
        rel = _rel(root, path)
        if rel in REGISTRY_MODULES:
            continue
        text = open(path, errors="replace").read()
        reads = python_raw_reads(text) if path.endswith(".py") else cpp_raw_reads(text)
        out += [f"{rel}:{no}: {line}" for no, line in reads]
    return out


# ---- every variable read is declared ----


def declared_names(root: str) -> set[str]:
    """The names the registry declares, read from its source (no build needed)."""
    text = open(os.path.join(root, REGISTRY)).read()
    return set(re.findall(r'\{\s*"([A-Za-z_][A-Za-z0-9_]*)",\s*"', text))


def _literal_raw_read_names(text: str, python: bool) -> list[str]:
    if python:
        return [name for _, _, name in sorted(_python_reads(text), key=lambda r: r[0]) if name]
    return re.findall(r"\bgetenv\(\s*\"" + NAME + '"', text)


def undeclared_reads(root: str, declared: set[str]) -> list[str]:
    """Variable names read by the package (through the registry or around it, any prefix) or named
    with our prefixes anywhere else, that the registry does not declare."""
    out = []
    for path in _files(root, PACKAGE, CPP_SUFFIXES + (".py",)):
        text = open(path, errors="replace").read()
        python = path.endswith(".py")
        names = (PY_REGISTRY_READ if python else CPP_REGISTRY_READ).findall(text)
        names += _literal_raw_read_names(text, python) + OURS.findall(text)
        out += [f"{_rel(root, path)}: {n}" for n in dict.fromkeys(names) if n not in declared]
    for path in _files(root, ELSEWHERE, CPP_SUFFIXES + (".py", ".sh", "run")):
        text = open(path, errors="replace").read()
        names = OURS.findall(text)
        if not path.endswith(CPP_SUFFIXES):
            names += [a or b for a, b in OURS_TPU.findall(text)]
        out += [f"{_rel(root, path)}: {n}" for n in dict.fromkeys(names) if n not in declared]
    return out


# ---- the tests ----


def test_readme_is_at_most_200_lines():
    violations = readme_violations(open(os.path.join(ROOT, "README.md")).read())
    assert not violations, violations[0]


def test_readme_guard_catches_a_long_readme():
    assert readme_violations("line\n" * README_LIMIT) == []
    assert "over the limit of 200" in readme_violations("line\n" * (README_LIMIT + 1))[0]


def test_links_in_readme_and_docs_resolve():
    violations = broken_links(ROOT, _doc_pages(ROOT))
    assert not violations, ("relative links to nothing (a page moved or renamed?): point each at the file it "
                            "means, relative to the page:\n  " + "\n  ".join(violations))


def test_link_guard_catches_a_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n")
    (tmp_path / "README.md").write_text(
        "[a](docs/a.md) [web](https://example.com) [gone](docs/gone.md#x)\n```\n[in code](nowhere.md)\n```\n")
    (tmp_path / "docs" / "b.md").write_text("[up](../README.md) [a](a.md#top) [bad](docs/a.md)\n")
    assert broken_links(str(tmp_path), _doc_pages(str(tmp_path))) == [
        "README.md: (docs/gone.md#x)", "docs/b.md: (docs/a.md)"]


def test_no_raw_environment_read_outside_the_registry():
    violations = raw_env_reads(ROOT)
    assert not violations, (
        "environment reads around the registry; declare the variable in csrc/runtime/env.cpp (name, type, "
        "default, who reads it and, for another program's variable, whose it is) and read it through "
        "tpu::env (runtime/env.h) in C++ or torch_tpu._env.get in Python, then regenerate docs/environment.md "
        "(python -m torch_tpu env --markdown > docs/environment.md):\n  " + "\n  ".join(violations))


def test_raw_read_guard_catches_each_form(tmp_path):
    (tmp_path / "csrc" / "runtime").mkdir(parents=True)
    (tmp_path / "torch_tpu").mkdir()
    (tmp_path / "csrc" / "runtime" / "env.cpp").write_text('const char* v = std::getenv("A");\n')
    (tmp_path / "torch_tpu" / "_env.py").write_text("import os\nos.environ.get('A')\n")
    (tmp_path / "csrc" / "a.cpp").write_text(
        '// std::getenv("X") in a comment\nconst char* s = "getenv(";\n'
        'const char* v = std::getenv("X");\nconst char* w = getenv("Y");\nextern char** environ;\n'
        'auto ok = env::get("X");\n')
    (tmp_path / "torch_tpu" / "a.py").write_text(
        "import os\n"
        "a = os.environ.get('X')\n"                 # 2: read
        "b = os.environ['X']\n"                     # 3: read
        "c = 'X' in os.environ\n"                   # 4: read
        "d = os.getenv('X')\n"                      # 5: read
        "e = os.environ.pop('X', None)\n"           # 6: read
        "f = os.environ.setdefault('X', '1')\n"     # 7: read (the value is used)
        "os.environ['X'] = '1'\n"                   # write
        "del os.environ['X']\n"                     # write
        "os.environ.setdefault('X', '1')\n"         # write (the decision above)
        "os.environ.update(X='1')\n"                # write
        "g = dict(os.environ)\n"                    # whole copy
        "h = {**os.environ, 'X': '1'}\n"            # whole copy
        "run(env=os.environ)\n"                     # whole copy
        "for k in os.environ: pass\n"               # 15: read
        "from os import environ\n"                  # 16: read
        "i = environ['X']\n")                       # 17: read
    got = raw_env_reads(str(tmp_path))
    assert [g.split(":")[0] + ":" + g.split(":")[1] for g in got] == [
        "csrc/a.cpp:3", "csrc/a.cpp:4", "csrc/a.cpp:5",
        "torch_tpu/a.py:2", "torch_tpu/a.py:3", "torch_tpu/a.py:4", "torch_tpu/a.py:5", "torch_tpu/a.py:6",
        "torch_tpu/a.py:7", "torch_tpu/a.py:15", "torch_tpu/a.py:16", "torch_tpu/a.py:17"], got


def test_every_variable_the_code_reads_is_declared():
    violations = undeclared_reads(ROOT, declared_names(ROOT))
    assert not violations, (
        "variables read or named but not declared: declare each in csrc/runtime/env.cpp (name, type, default, "
        "who reads it and, for another program's variable, whose it is), rebuild, and regenerate "
        "docs/environment.md (python -m torch_tpu env --markdown > docs/environment.md):\n  "
        + "\n  ".join(violations))


def test_declared_guard_catches_undeclared_names_of_any_prefix(tmp_path):
    (tmp_path / "csrc" / "runtime").mkdir(parents=True)
    (tmp_path / "torch_tpu").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "tests" / "cpp").mkdir(parents=True)
    (tmp_path / "csrc" / "runtime" / "env.cpp").write_text(
        '      {"TORCH_TPU_" "KNOWN", "0/1", "", "runtime", "known"},\n      {"KNOWN", "text", "", "x", "y"},\n')
    declared = declared_names(str(tmp_path))
    assert declared == {"KNOWN"}  # a split literal is not a declaration
    declared |= {"TORCH_TPU_" "KNOWN"}
    (tmp_path / "csrc" / "a.cpp").write_text(
        'env::get("KNOWN"); env::enabled("OTHER_PROGRAMS_VAR"); std::getenv("RAW_READ");\n'
        'env::get("TORCH_TPU_' 'KNOWN"); int TPU_SOME_MACRO = 1;\n')
    (tmp_path / "torch_tpu" / "a.py").write_text(
        "_env.get('VLLM_T" "PU_NEW')\nos.environ.get('PY_RAW')\n'IN_CHECK' in os.environ\n_env.get('KNOWN')\n")
    (tmp_path / "scripts" / "a.sh").write_text('echo "${TORCH_TPU_' 'SCRIPT:-1}" $TPU_' 'SHELL\n')
    (tmp_path / "tests" / "cpp" / "a_test.cpp").write_text('EXPECT_THROW(env::find("TPU_' 'REFUSED"));\n')
    got = undeclared_reads(str(tmp_path), declared)
    assert got == ["csrc/a.cpp: OTHER_PROGRAMS_VAR", "csrc/a.cpp: RAW_READ",
                   "torch_tpu/a.py: VLLM_T" "PU_NEW", "torch_tpu/a.py: PY_RAW", "torch_tpu/a.py: IN_CHECK",
                   "scripts/a.sh: TORCH_TPU_" "SCRIPT", "scripts/a.sh: TPU_" "SHELL"], got
