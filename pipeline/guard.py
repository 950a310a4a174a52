"""Lexical guard for semantic dedup: vetoes a merge when two texts differ in a way that changes meaning.

Embeddings put "lock my card" and "unlock my card" close together; the guard is what keeps them
apart. It is called by :func:`pipeline.dedup.cluster` for every candidate (follower, leader) pair
whose cosine similarity passed the threshold, and by the inference agent before it serves a
semantic-cache hit. Exact normalised matches do not consult it.

A merge is vetoed when the two texts differ in:

* negation: the number of negating words (``not``, ``never``, ``don't``, ``without`` ...; Chinese
  不, 没, 别, 未, 无 ...);
* opposite actions: the set of words drawn from :data:`OPPOSITE_ACTIONS` present in each text
  (``increase``/``decrease``, ``lock``/``unlock`` ...). One side having such a word that the other
  lacks is enough. Common function words with an opposite (``on``/``off``, ``from``/``to``) are in
  :data:`WEAK_OPPOSITES` and veto only when one text has one side and the other the other side;
* numbers (digits and number words, as a multiset), currencies, percent, dates (months, weekdays,
  relative days) and account references (masked numbers like ``****1234``, IBAN-like tokens);
* the source of a movement: when both texts say "from X", X must be the same word.

All checks compare features of each text for equality, so the guard is symmetric. The word lists
are module-level constants: extend them there.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache

#: English words that negate; any token ending in ``n't`` also counts.
NEGATIONS_EN: frozenset[str] = frozenset(
    {
        "not", "no", "never", "none", "nothing", "nobody", "nowhere", "neither", "nor", "without",
        "cannot", "unable", "dont", "didnt", "doesnt", "isnt", "wasnt", "arent", "werent", "cant",
        "wont", "wouldnt", "couldnt", "shouldnt", "havent", "hasnt", "hadnt", "mustnt", "aint",
    }
)  # fmt: skip

#: Chinese negating characters, counted wherever they occur (没有 counts through 没, 无法 through 无).
NEGATIONS_ZH: frozenset[str] = frozenset(
    {"不", "没", "沒", "别", "別", "未", "无", "無", "非", "勿", "莫", "甭", "否"}
)

#: Opposite actions: a merge is vetoed when the texts' sets of these words differ. Each entry is a
#: pair of base words; inflections (-s, -es, -ed, -d, -ing, doubled consonants) are derived, irregular
#: forms are listed in :data:`IRREGULAR_FORMS`.
OPPOSITE_ACTIONS: tuple[tuple[str, str], ...] = (
    ("increase", "decrease"), ("raise", "lower"), ("higher", "lower"), ("open", "close"),
    ("enable", "disable"), ("lock", "unlock"), ("freeze", "unfreeze"), ("activate", "deactivate"),
    ("block", "unblock"), ("buy", "sell"), ("deposit", "withdraw"), ("add", "remove"), ("start", "stop"),
    ("subscribe", "unsubscribe"), ("credit", "debit"), ("send", "receive"), ("link", "unlink"),
    ("connect", "disconnect"), ("accept", "decline"), ("approve", "decline"), ("accept", "reject"),
    ("approve", "reject"), ("charge", "refund"), ("show", "hide"), ("allow", "deny"),
    ("upgrade", "downgrade"), ("include", "exclude"), ("borrow", "lend"), ("fail", "succeed"),
    ("maximum", "minimum"), ("max", "min"), ("incoming", "outgoing"), ("domestic", "international"),
    ("login", "logout"), ("verify", "unverify"), ("pause", "resume"), ("suspend", "reinstate"),
)  # fmt: skip

#: Irregular or derived forms of the words in :data:`OPPOSITE_ACTIONS`.
IRREGULAR_FORMS: dict[str, tuple[str, ...]] = {
    "buy": ("bought",),
    "sell": ("sold",),
    "send": ("sent",),
    "withdraw": ("withdrew", "withdrawn", "withdrawal", "withdrawals"),
    "freeze": ("froze", "frozen"),
    "unfreeze": ("unfroze", "unfrozen"),
    "lend": ("lent",),
    "fail": ("failure", "failures"),
    "succeed": ("success", "successful", "successfully"),
    "close": ("closure",),
    "deny": ("denied", "denies"),
    "login": ("log-in",),
    "logout": ("log-out",),
    "maximum": ("max",),
    "minimum": ("min",),
}

#: Function words with an opposite; veto only when one text has one side (not the other) and the
#: other text has the other side (not the first).
WEAK_OPPOSITES: tuple[tuple[str, str], ...] = (
    ("on", "off"), ("in", "out"), ("up", "down"), ("more", "less"), ("before", "after"), ("from", "to"),
    ("above", "below"), ("over", "under"), ("first", "last"), ("last", "next"), ("new", "old"),
    ("early", "late"), ("am", "pm"), ("into", "out"), ("inside", "outside"), ("yes", "no"),
    ("east", "west"), ("north", "south"),
)  # fmt: skip

#: Chinese opposite actions, matched as substrings (Chinese has no spaces between words).
OPPOSITE_ACTIONS_ZH: tuple[tuple[str, str], ...] = (
    ("增加", "减少"), ("提高", "降低"), ("上调", "下调"), ("开通", "关闭"), ("打开", "关闭"),
    ("启用", "禁用"), ("激活", "停用"), ("锁定", "解锁"), ("冻结", "解冻"), ("买", "卖"), ("存", "取"),
    ("充值", "提现"), ("发送", "接收"), ("转入", "转出"), ("收款", "付款"), ("升级", "降级"),
    ("开始", "停止"), ("订阅", "退订"), ("添加", "删除"), ("绑定", "解绑"), ("最高", "最低"), ("借", "还"),
)  # fmt: skip

#: English number words, mapped to the digits they stand for ("one" is left out: mostly a pronoun).
NUMBER_WORDS: dict[str, str] = {
    "zero": "0", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6", "seven": "7",
    "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12", "twenty": "20",
    "thirty": "30", "forty": "40", "fifty": "50", "hundred": "100", "thousand": "1000",
    "million": "1000000", "billion": "1000000000", "half": "0.5", "double": "x2", "twice": "x2",
    "triple": "x3",
}  # fmt: skip

#: Words skipped when reading what follows "from" ("from my savings" -> "savings").
DETERMINERS: frozenset[str] = frozenset(
    {"my", "the", "a", "an", "your", "our", "his", "her", "their", "this", "that"}
)

#: Chinese numeral characters; runs of them are compared like numbers.
NUMERALS_ZH = "零〇一二三四五六七八九十百千万亿两"

#: Currency words and codes mapped to one code per currency.
CURRENCIES: dict[str, str] = {
    "$": "usd", "usd": "usd", "dollar": "usd", "dollars": "usd", "美元": "usd",
    "€": "eur", "eur": "eur", "euro": "eur", "euros": "eur", "欧元": "eur",
    "£": "gbp", "gbp": "gbp", "pound": "gbp", "pounds": "gbp", "quid": "gbp", "英镑": "gbp",
    "¥": "yen-or-yuan", "yen": "jpy", "jpy": "jpy", "日元": "jpy",
    "yuan": "cny", "rmb": "cny", "cny": "cny", "人民币": "cny", "元": "cny", "块": "cny",
    "chf": "chf", "franc": "chf", "francs": "chf", "cad": "cad", "aud": "aud", "nzd": "nzd",
    "inr": "inr", "₹": "inr", "rupee": "inr", "rupees": "inr", "₽": "rub",
    "sek": "sek", "nok": "nok", "dkk": "dkk", "pln": "pln", "zł": "pln", "huf": "huf", "czk": "czk",
    "hkd": "hkd", "sgd": "sgd", "krw": "krw", "₩": "krw", "₺": "try",
    "mxn": "mxn", "brl": "brl", "zar": "zar", "btc": "btc", "bitcoin": "btc", "eth": "eth",
    "%": "percent", "percent": "percent", "per cent": "percent", "percentage": "percent",
}  # fmt: skip

#: Date words, mapped to one name each ("may" is left out: mostly the verb).
DATE_WORDS: dict[str, str] = {
    "january": "jan", "jan": "jan", "february": "feb", "feb": "feb", "march": "mar",
    "april": "apr", "apr": "apr", "june": "jun", "jun": "jun", "july": "jul", "jul": "jul",
    "august": "aug", "aug": "aug", "september": "sep", "sept": "sep", "sep": "sep",
    "october": "oct", "oct": "oct", "november": "nov", "nov": "nov", "december": "dec", "dec": "dec",
    "monday": "mon", "mon": "mon", "tuesday": "tue", "tue": "tue", "wednesday": "wed", "wed": "wed",
    "thursday": "thu", "thu": "thu", "friday": "fri", "fri": "fri", "saturday": "sat",
    "sunday": "sun", "today": "today", "tonight": "today", "tomorrow": "tomorrow",
    "yesterday": "yesterday", "weekend": "weekend",
    "今天": "today", "明天": "tomorrow", "昨天": "yesterday", "前天": "day-before-yesterday",
    "后天": "day-after-tomorrow", "周末": "weekend",
}  # fmt: skip

_WORD_RE = re.compile(r"[^\W\d_]+(?:['-][^\W\d_]+)*")
_NUMBER_RE = re.compile(r"\d+(?:[.,]\d+)*")
_DATE_RE = re.compile(r"\d+(?:[/-]\d+)+|\d{1,2}\.\d{1,2}\.\d{2,4}\b")
_MASKED_RE = re.compile(r"(?:[*•#]|x(?=[x\d])){2,}\s?(\d{2,})")
_TOKEN_RE = re.compile(r"[\w*•#]+")
_ZH_NUMERAL_RE = re.compile(f"[{NUMERALS_ZH}]+")
_ZH_WEEKDAY_RE = re.compile(r"(?:星期|周|礼拜)([一二三四五六日天])")
_NUMBER_UNIT_RE = re.compile(r"^\d+[^\W\d_]{1,3}$")
_SHORT_PREFIXED_RE = re.compile(r"^[^\W\d_]{1,3}\d{1,3}$")
_US_THOUSANDS_RE = re.compile(r"^\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_COMMA_DECIMAL_RE = re.compile(r"^\d+,\d{1,2}$")


def _inflections(word: str) -> set[str]:
    """Regular English inflections of ``word``, plus its irregular forms."""
    forms = {word, word + "s", word + "es", word + "ed", word + "ing"}
    if word.endswith("e"):
        forms |= {word + "d", word[:-1] + "ing"}
    if word.endswith("y"):
        forms |= {word[:-1] + "ies", word[:-1] + "ied"}
    if len(word) >= 3 and word[-1] not in "aeiouwxy" and word[-2] in "aeiou" and word[-3] not in "aeiou":
        forms |= {word + word[-1] + "ed", word + word[-1] + "ing"}
    forms.update(IRREGULAR_FORMS.get(word, ()))
    return forms


def _build_lexicon() -> dict[str, frozenset[str]]:
    """Map each surface form to the base words (of :data:`OPPOSITE_ACTIONS`) it stands for."""
    lexicon: dict[str, set[str]] = {}
    for pair in OPPOSITE_ACTIONS:
        for base in pair:
            for form in _inflections(base):
                lexicon.setdefault(form, set()).add(base)
    return {form: frozenset(bases) for form, bases in lexicon.items()}


_ACTION_LEXICON: dict[str, frozenset[str]] = _build_lexicon()
_WEAK_WORDS: frozenset[str] = frozenset(w for pair in WEAK_OPPOSITES for w in pair)


@dataclass(frozen=True)
class GuardFeatures:
    """What the guard compares, extracted once per text (see :func:`features`)."""

    negations: int
    actions: frozenset[str]
    weak: frozenset[str]
    numbers: tuple[str, ...]
    currencies: frozenset[str]
    dates: frozenset[str]
    refs: frozenset[str]
    sources: frozenset[str]


def _canonical_number(token: str) -> str:
    """``"1,000.50"`` -> ``"1000.5"``; ``"12,5"`` -> ``"12.5"``; ``"05"`` -> ``"5"``."""
    text = token
    if _US_THOUSANDS_RE.match(text):
        text = text.replace(",", "")
    elif _COMMA_DECIMAL_RE.match(text):
        text = text.replace(",", ".")
    whole, _, fraction = text.partition(".")
    whole = whole.lstrip("0") or "0"
    fraction = fraction.rstrip("0")
    return f"{whole}.{fraction}" if fraction else whole


def _canonical_date(token: str) -> str:
    """``"03/04/2024"`` -> ``"date:3/4/2024"``: separators unified, leading zeros dropped, order kept."""
    return "date:" + "/".join(part.lstrip("0") or "0" for part in re.split(r"[/.-]", token))


def _prepare(text: str) -> str:
    """NFKC, casefold and plain apostrophes; the text the features are read from."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return text.replace("\u2019", "'").replace("\u2018", "'").replace("`", "'")


def _is_reference(token: str) -> bool:
    """An account or transaction reference: letters and at least two digits mixed (IBAN-like)."""
    digits = sum(ch.isdigit() for ch in token)
    letters = sum(ch.isalpha() for ch in token)
    if digits < 2 or letters < 1:
        return False
    return not (_NUMBER_UNIT_RE.match(token) or _SHORT_PREFIXED_RE.match(token))


@lru_cache(maxsize=65536)
def features(text: str) -> GuardFeatures:
    """Extract the guard's features of ``text``; cached, since a leader is compared many times."""
    prepared = _prepare(text)
    # split letters from digits so that "10am" and "50eur" read as "10 am" and "50 eur"
    spaced = re.sub(r"(?<=\d)(?=[^\W\d_])|(?<=[^\W\d_])(?=\d)", " ", prepared)
    words = [w for w in _WORD_RE.findall(spaced)]
    word_set = set(words)

    negations = sum(1 for w in words if w in NEGATIONS_EN or w.endswith("n't"))
    negations += sum(1 for ch in prepared if ch in NEGATIONS_ZH)

    actions: set[str] = set()
    for w in words:
        actions.update(_ACTION_LEXICON.get(w, ()))
    for a, b in OPPOSITE_ACTIONS_ZH:
        actions.update(x for x in (a, b) if x in prepared)

    # dates like 3/4/2024 stay one token (3/4/2024 is not 4/3/2024); other numbers form a multiset
    numbers = [_canonical_date(d) for d in _DATE_RE.findall(prepared)]
    numbers += [_canonical_number(n) for n in _NUMBER_RE.findall(_DATE_RE.sub(" ", prepared))]
    numbers += [NUMBER_WORDS[w] for w in words if w in NUMBER_WORDS]
    numbers += ["zh:" + run for run in _ZH_NUMERAL_RE.findall(prepared)]

    currencies = {CURRENCIES[w] for w in words if w in CURRENCIES}
    currencies |= {CURRENCIES[ch] for ch in prepared if ch in CURRENCIES}
    currencies |= {code for key, code in CURRENCIES.items() if not key.isascii() and key in prepared}
    currencies |= {code for key, code in CURRENCIES.items() if " " in key and key in prepared}
    currencies |= {
        "symbol:" + ch for ch in prepared if unicodedata.category(ch) == "Sc" and ch not in CURRENCIES
    }

    dates = {DATE_WORDS[w] for w in words if w in DATE_WORDS}
    dates |= {name for key, name in DATE_WORDS.items() if not key.isascii() and key in prepared}
    dates |= {"weekday:" + d for d in _ZH_WEEKDAY_RE.findall(prepared)}

    refs = {"masked:" + m for m in _MASKED_RE.findall(prepared)}
    refs |= {t for t in _TOKEN_RE.findall(prepared) if _is_reference(t)}

    sources = set()
    for i, w in enumerate(words):
        if w == "from":
            rest = [x for x in words[i + 1 : i + 4] if x not in DETERMINERS]
            if rest:
                sources.add(rest[0])

    return GuardFeatures(
        negations=negations,
        actions=frozenset(actions),
        weak=frozenset(word_set & _WEAK_WORDS),
        numbers=tuple(sorted(numbers)),
        currencies=frozenset(currencies),
        dates=frozenset(dates),
        refs=frozenset(refs),
        sources=frozenset(sources),
    )


def _weak_conflict(a: frozenset[str], b: frozenset[str]) -> tuple[str, str] | None:
    """The first weak pair that ``a`` and ``b`` take opposite sides of, in a fixed order."""
    for x, y in WEAK_OPPOSITES:
        if (x in a and y not in a and y in b and x not in b) or (
            y in a and x not in a and x in b and y not in b
        ):
            return (x, y)
    return None


def compatible(fa: GuardFeatures, fb: GuardFeatures) -> tuple[bool, str | None]:
    """Compare two texts' features; ``(False, reason)`` on the first difference that changes meaning.

    The reason names what differs without saying which side had it, so it is symmetric too.
    """
    if fa.negations != fb.negations:
        return False, "negation differs"
    if fa.actions != fb.actions:
        return False, "opposite actions: " + "/".join(sorted(fa.actions ^ fb.actions))
    weak = _weak_conflict(fa.weak, fb.weak)
    if weak is not None:
        return False, "opposite words: " + "/".join(weak)
    if fa.numbers != fb.numbers:
        return False, "numbers differ: " + ",".join(sorted(set(fa.numbers) ^ set(fb.numbers)) or ["count"])
    if fa.currencies != fb.currencies:
        return False, "currencies differ: " + ",".join(sorted(fa.currencies ^ fb.currencies))
    if fa.dates != fb.dates:
        return False, "dates differ: " + ",".join(sorted(fa.dates ^ fb.dates))
    if fa.refs != fb.refs:
        return False, "account references differ"
    if fa.sources and fb.sources and fa.sources != fb.sources:
        return False, "source differs: " + "/".join(sorted(fa.sources ^ fb.sources))
    return True, None


def guard_allows(a: str, b: str) -> tuple[bool, str | None]:
    """Whether texts ``a`` and ``b`` may share one answer; ``(False, reason)`` when vetoed.

    Called for every pair whose embeddings are close enough; symmetric in ``a`` and ``b``.
    """
    return compatible(features(a), features(b))
