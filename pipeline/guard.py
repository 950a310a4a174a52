"""Lexical guard for semantic dedup: vetoes a merge when two texts differ in a way that changes meaning.

Embeddings put "lock my card" and "unlock my card" close together; the guard is what keeps them
apart. It is called by :func:`pipeline.dedup.cluster` for every candidate (follower, leader) pair
whose cosine similarity passed the threshold, and by the inference agent before it serves a
semantic-cache hit. Exact normalised matches do not consult it.

A merge is vetoed when the two texts differ in:

* negation: the number of negating words (``not``, ``never``, ``don't``, ``without``, ``yet to`` ...; Chinese
  不, 没, 别, 未, 无 ...);
* a reported problem: one text says something went wrong (a negation, or a word of
  :data:`PROBLEM_WORDS_EN` such as ``trouble``, ``error``, ``failed``) and the other does not
  ("I'm having trouble verifying my identity" is not "how do I verify my identity");
* opposite actions: the set of words drawn from :data:`OPPOSITE_ACTIONS` present in each text
  (``increase``/``decrease``, ``lock``/``unlock`` ...). One side having such a word that the other
  lacks is enough. Common function words with an opposite (``on``/``off``, ``from``/``to``) are in
  :data:`WEAK_OPPOSITES` and veto only when one text has one side and the other the other side ("to"
  after a word of :data:`INFINITIVE_GOVERNORS`, "like to pay", marks an infinitive and does not count);
* numbers (digits and number words, as a multiset; "two times" reads as "twice"), currencies, percent, dates (months, weekdays,
  relative days) and account references (masked numbers like ``****1234``, IBAN-like tokens);
* the source of a movement: when both texts say "from X", X must be the same word;
* antonyms (:data:`ANTONYMS_EN`, :data:`ANTONYMS_ZH`, by category: evaluation, price and amount,
  size, speed and time, state, direction, person): one text has one side of a pair and the other text
  the other side ("cheap"/"expensive", "faster"/"slower", 高/低, 多/少; "charged"/"declined", a
  payment's outcome). English degree and adverb
  forms are derived (cheaper, cheapest, quickly);
* morphological negation: one text has a word and the other the same word with a negating prefix
  (``un-``, ``in-``, ``im-``, ``il-``, ``ir-``, ``dis-``, ``non-``: "safe"/"unsafe",
  "available"/"unavailable", "refundable"/"non-refundable") or with ``-less`` for ``-ful``.

Chinese words whose character does not carry the listed sense (非常 "very", 是否 "whether", 关于
"about", 多少 "how many", 取消 "cancel" ...) are masked out before Chinese characters are matched
(:data:`MASKED_COMPOUNDS_ZH`).

Two strengths. :func:`guard_allows` (``strict=True``) also vetoes when one text names an action of
:data:`OPPOSITE_ACTIONS` that the other does not name at all; :func:`hard_conflict` vetoes only real
oppositions (one side X, the other side its opposite) and leaves the one-sided action word to the
learned merge decision (:mod:`pipeline.pairs`), which reads it as a feature
(:func:`action_asymmetry`). All checks compare features of each text, so the guard is symmetric. The
word lists are module-level constants: extend them there.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import unicodedata
from dataclasses import dataclass

from pipeline.textcache import TextCache

# The tables of pairs and mappings below (antonyms, opposite actions, number, currency and date
# words) keep ``# fmt: skip``: they are hand-laid-out data, a few pairs or one currency a row, that
# ruff format would spread to one item a line. The plain word lists are split strings instead.

#: English words that negate; any token ending in ``n't`` also counts.
NEGATIONS_EN: frozenset[str] = frozenset(
    (
        "not no never none nothing nobody nowhere neither nor without cannot unable dont didnt "
        "doesnt isnt wasnt arent werent cant wont wouldnt couldnt shouldnt havent hasnt hadnt "
        "mustnt aint"
    ).split()
)

#: Chinese negating characters, counted wherever they occur (没有 counts through 没, 无法 through 无).
NEGATIONS_ZH: frozenset[str] = frozenset(
    {"不", "没", "沒", "别", "別", "未", "无", "無", "非", "勿", "莫", "甭", "否"}
)

#: Chinese words made with a negating character that do not negate ("very", "whether", "future",
#: "regardless", "other people" ...); masked out before negations are counted.
NEGATION_FREE_ZH: tuple[str, ...] = tuple(
    (
        "非常 是否 能否 可否 否则 无论 不论 不过 不仅 不但 不断 未来 无线 别人 别的 区别 特别 "
        "分别 差别 告别 识别 级别 类别 性别 莫名"
    ).split()
)

#: English antonym pairs by category: vetoed when one text has one side (and not the other) and the
#: other text the other side. Degree and adverb forms (-er, -est, -ly) and plurals are derived;
#: irregular ones are in :data:`ANTONYM_FORMS`.
ANTONYMS_EN: dict[str, tuple[tuple[str, str], ...]] = {
    "evaluation": (
        ("good", "bad"), ("right", "wrong"), ("correct", "wrong"), ("positive", "negative"),
        ("true", "false"), ("easy", "hard"), ("easy", "difficult"), ("simple", "complicated"),
        ("happy", "sad"), ("happy", "angry"), ("love", "hate"), ("like", "hate"), ("success", "failure"),
        ("safe", "dangerous"), ("safe", "risky"), ("secure", "vulnerable"), ("strong", "weak"),
        ("clean", "dirty"), ("polite", "rude"), ("useful", "useless"), ("best", "worst"),
    ),
    "price": (
        ("cheap", "expensive"), ("cheap", "costly"), ("free", "paid"), ("high", "low"), ("rich", "poor"),
        ("profit", "loss"), ("gain", "loss"), ("win", "lose"), ("discount", "surcharge"),
    ),
    "size": (
        ("big", "small"), ("large", "small"), ("big", "little"), ("long", "short"), ("tall", "short"),
        ("many", "few"), ("most", "least"), ("full", "empty"), ("heavy", "light"), ("wide", "narrow"),
        ("thick", "thin"), ("deep", "shallow"), ("huge", "tiny"),
    ),
    "speed_time": (
        ("fast", "slow"), ("quick", "slow"), ("early", "late"), ("young", "old"), ("past", "future"),
        ("morning", "evening"), ("day", "night"), ("daily", "weekly"), ("weekly", "monthly"),
        ("monthly", "yearly"), ("monthly", "annual"), ("temporary", "permanent"), ("soon", "later"),
    ),
    "state": (
        ("hot", "cold"), ("warm", "cold"), ("wet", "dry"), ("light", "dark"), ("loud", "quiet"),
        ("hard", "soft"), ("public", "private"), ("same", "different"), ("present", "absent"),
        ("alive", "dead"), ("online", "offline"), ("internal", "external"), ("import", "export"),
        ("arrive", "depart"), ("pass", "fail"), ("push", "pull"), ("visible", "hidden"),
        ("physical", "virtual"), ("physical", "digital"), ("personal", "business"), ("single", "joint"),
        ("local", "foreign"), ("manual", "automatic"), ("expired", "valid"), ("busy", "idle"),
    ),
    "direction": (
        ("left", "right"), ("top", "bottom"), ("front", "back"), ("forward", "backward"),
        ("inbound", "outbound"), ("upload", "download"), ("import", "export"),
    ),
    "person": (
        ("man", "woman"), ("men", "women"), ("boy", "girl"), ("male", "female"), ("husband", "wife"),
        ("father", "mother"), ("son", "daughter"), ("brother", "sister"), ("gentleman", "lady"),
        ("king", "queen"), ("adult", "child"), ("adults", "children"), ("buyer", "seller"),
        ("sender", "recipient"), ("employer", "employee"), ("landlord", "tenant"),
    ),
    # what happened to a payment: money taken, or not taken
    "outcome": (("charge", "decline"), ("charge", "cancel"), ("charge", "reject")),
}  # fmt: skip

#: Irregular forms of words in :data:`ANTONYMS_EN`.
ANTONYM_FORMS: dict[str, tuple[str, ...]] = {
    "good": ("better", "best", "well"),
    "bad": ("worse", "worst", "badly"),
    "many": ("more", "most"),
    "few": ("fewer", "fewest"),
    "little": ("less", "least"),
    "lose": ("lost", "losing", "loses"),
    "win": ("won", "winning", "wins"),
    "pay": ("paid",),
    "hide": ("hidden",),
    "charge": ("charged", "charging"),
    "decline": ("declined", "declining"),
    "cancel": ("cancelled", "canceled", "cancelling", "canceling", "cancellation"),
    "reject": ("rejected", "rejecting", "rejection"),
}

#: Words that report a problem without a negating word ("I'm having trouble verifying"): a text with
#: one of these or a negation reports that something went wrong; a text with neither asks how to do
#: something. The two are different questions ("trouble verifying my identity" is not "how do I
#: verify my identity"). "issue" is left out: it is also a verb ("issue a new card").
PROBLEM_WORDS_EN: frozenset[str] = frozenset(
    "trouble troubles problem problems error errors stuck broken fail fails failed failing failure".split()
)

#: Chinese words that report a problem, matched as substrings (问题 is left out: it also means "question").
PROBLEM_WORDS_ZH: tuple[str, ...] = ("故障", "出错", "报错", "卡住", "失灵", "异常", "失败")

#: Prefixes that negate the word they are put in front of; "safe"/"unsafe" is vetoed when one text
#: has the word and the other the prefixed word (and not the word itself).
NEGATING_PREFIXES: tuple[str, ...] = ("un", "in", "im", "il", "ir", "dis", "non-", "non")

#: Prefixed words whose prefix does not negate, even when the rest is a word ("improve", "inform").
PREFIX_FALSE_FRIENDS: frozenset[str] = frozenset(
    (
        "discover disclose discount dispatch display dispose disposable dispute discuss distance "
        "district improve import impose impress inform install insure income invest invoice "
        "intend inside insight input inflow index infix involve impact impart illegible unit "
        "union unite until under understand indent inbound invert implant impound"
    ).split()
)

#: Chinese antonym pairs by category, matched as substrings after masking
#: :data:`MASKED_COMPOUNDS_ZH`; vetoed like :data:`ANTONYMS_EN`.
ANTONYMS_ZH: dict[str, tuple[tuple[str, str], ...]] = {
    "evaluation": (("好", "坏"), ("对", "错"), ("正确", "错误"), ("成功", "失败"), ("安全", "危险"),
                   ("容易", "困难"), ("简单", "复杂"), ("真", "假"), ("喜欢", "讨厌")),
    "price": (("便宜", "贵"), ("免费", "收费"), ("高", "低"), ("涨", "跌"), ("盈利", "亏损"), ("赢", "输")),
    "size": (("多", "少"), ("大", "小"), ("长", "短"), ("胖", "瘦"), ("深", "浅"), ("宽", "窄"),
             ("粗", "细"), ("重", "轻")),
    "speed_time": (("快", "慢"), ("早", "晚"), ("新", "旧"), ("老", "新"), ("以前", "以后"), ("之前", "之后"),
                   ("上午", "下午"), ("白天", "晚上"), ("临时", "永久")),
    "state": (("开", "关"), ("冷", "热"), ("干", "湿"), ("明", "暗"), ("公", "私"), ("在线", "离线"),
              ("国内", "国外"), ("国内", "境外"), ("进口", "出口"), ("有效", "失效"), ("上线", "下线")),
    "direction": (("左", "右"), ("南", "北"), ("收入", "支出"), ("转入", "转出"), ("上涨", "下跌"),
                  ("上升", "下降"), ("进", "出")),
    "person": (("男", "女"), ("丈夫", "妻子"), ("父亲", "母亲"), ("儿子", "女儿"), ("哥哥", "姐姐"),
               ("买家", "卖家"), ("房东", "租客")),
    "outcome": (("扣款", "退款"),),
}  # fmt: skip

#: Chinese words in which a character of the lists above does not carry its listed sense (关于 "about",
#: 多少 "how many", 取消 "cancel", 还是 "or", 开心 "happy", 新闻 "news" ...): masked out before the
#: antonym and opposite-action characters are matched.
MASKED_COMPOUNDS_ZH: tuple[str, ...] = tuple(
    (
        "关于 关系 相关 有关 关注 海关 机关 开心 离开 公开 开发 开展 多少 至少 不少 多久 大家 "
        "大概 大约 大学 大小 长短 小时 小心 小姐 行长 部长 成长 长度 短信 快递 尽快 愉快 重新 "
        "重要 严重 新闻 高兴 好像 好的 你好 您好 好吗 只好 最好 对于 对方 针对 面对 对话 取消 "
        "存在 还是 还有 还没 还在 还能 还要 还会 还可 进行 出现 出来 干净 明白 明天 说明 证明 "
        "公司 公里 老师 干什么 多长 晚饭 早饭 左右 真的 热情 进入 出去 老板"
    ).split()
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

#: Words after which "to" marks an infinitive ("I'd like to pay", "how long do I have to wait"), not a
#: direction: such a "to" is not the weak opposite of "from".
INFINITIVE_GOVERNORS: frozenset[str] = frozenset(
    (
        "want wants wanted wanting like liked love would need needs needed have has had having able "
        "unable how try tries tried trying going wish hope hoping plan planning planned decide decided "
        "allowed possible impossible way forgot forget attempt attempted attempting supposed used meant "
        "ought easy hard required necessary time what where which whether order seem seems seemed "
        "appear appears manage managed enough permitted eligible due according"
    ).split()
)

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
_TIMES_RE = re.compile(r"(?<![\w.,])(\d+|[^\W\d_]+) times\b")
# A pattern that can start anywhere inside a long run of what it repeats, and then fail, costs the
# run's length at every position: quadratic (32 KiB of digits took 42 s). The lookbehinds below let a
# match start only where the run starts; a match that could start later in the run could start at its
# beginning too, with the same groups, so what is found is unchanged (docs/architecture.md, "Security").
_DATE_RE = re.compile(r"(?<!\d)\d+(?:[/-]\d+)+|\d{1,2}\.\d{1,2}\.\d{2,4}\b")
_MASKED_RE = re.compile(r"(?<![*•#])(?<!x(?=[x\d]))(?:[*•#]|x(?=[x\d])){2,}\s?(\d{2,})")
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


def _degree_forms(word: str) -> set[str]:
    """``word`` with plural, comparative, superlative and adverb endings (cheap -> cheaper, cheapest,
    cheaply; big -> bigger; easy -> easier, easily), plus :data:`ANTONYM_FORMS`."""
    forms = {word, word + "s", word + "er", word + "est", word + "ly"}
    if word.endswith("e"):
        forms |= {word + "r", word + "st", word[:-1] + "ly"}
    if word.endswith("y"):
        forms |= {word[:-1] + "ier", word[:-1] + "iest", word[:-1] + "ily"}
    if len(word) >= 3 and word[-1] not in "aeiouwxy" and word[-2] in "aeiou" and word[-3] not in "aeiou":
        forms |= {word + word[-1] + "er", word + word[-1] + "est"}
    forms.update(ANTONYM_FORMS.get(word, ()))
    return forms


_ANTONYM_PAIRS_EN: tuple[tuple[str, str], ...] = tuple(
    dict.fromkeys(pair for pairs in ANTONYMS_EN.values() for pair in pairs)
)
_ANTONYM_PAIRS_ZH: tuple[tuple[str, str], ...] = tuple(
    dict.fromkeys(pair for pairs in ANTONYMS_ZH.values() for pair in pairs)
)


def _build_poles() -> dict[str, frozenset[tuple[int, int]]]:
    """Map each surface form to the (antonym pair, side) it stands for."""
    poles: dict[str, set[tuple[int, int]]] = {}
    for k, pair in enumerate(_ANTONYM_PAIRS_EN):
        for side, base in enumerate(pair):
            for form in _degree_forms(base):
                poles.setdefault(form, set()).add((k, side))
    return {form: frozenset(v) for form, v in poles.items()}


_POLE_LEXICON: dict[str, frozenset[tuple[int, int]]] = _build_poles()
_ZH_OFFSET = len(_ANTONYM_PAIRS_EN)


_HAN_RE = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f]")
_NON_ASCII_CURRENCIES = tuple((k, c) for k, c in CURRENCIES.items() if not k.isascii())
_SPACED_CURRENCIES = tuple((k, c) for k, c in CURRENCIES.items() if " " in k)
_NON_ASCII_DATES = tuple((k, n) for k, n in DATE_WORDS.items() if not k.isascii())


def _mask_zh(prepared: str) -> str:
    for compound in MASKED_COMPOUNDS_ZH:
        if compound in prepared:
            prepared = prepared.replace(compound, "\u3000")
    return prepared


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
    #: (antonym pair, side) taken by the text; pairs of :data:`ANTONYMS_ZH` follow those of English
    poles: frozenset[tuple[int, int]] = frozenset()
    words: frozenset[str] = frozenset()
    #: the text reports that something went wrong: a negation or a word of :data:`PROBLEM_WORDS_EN`
    reports_problem: bool = False
    #: a digest of what follows the first :data:`GUARD_TEXT_CHARS` characters ("" when nothing does)
    rest: str = ""


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


#: how much of a text the guard reads: its first 2,000 characters after NFKC and casefolding. A
#: question is far shorter; the bound keeps the cost and size of a text's features independent of the
#: content limit (32 KiB). What lies past it is compared whole (:attr:`GuardFeatures.rest`): two texts
#: that differ there never merge (docs/architecture.md, "Semantic dedup").
GUARD_TEXT_CHARS = 2_000


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


#: texts whose guard features are kept: a question's take about 3 KB, so the count binds first
#: (about 25 MiB); long texts' take up to about 30 KiB, and the bytes bind. Every distinct question a
#: client sends passes through here, so the bound is on memory as much as on time.
FEATURES_CACHE = 8_192
FEATURES_CACHE_BYTES = 32 << 20


def _features(text: str) -> GuardFeatures:
    """Extract the guard's features of ``text`` (of its first :data:`GUARD_TEXT_CHARS` characters)."""
    prepared = _prepare(text)
    remainder = ""
    if len(prepared) > GUARD_TEXT_CHARS:
        tail = prepared[GUARD_TEXT_CHARS:].encode("utf-8", "surrogatepass")
        remainder = hashlib.blake2b(tail, digest_size=16).hexdigest()
        prepared = prepared[:GUARD_TEXT_CHARS]
    # split letters from digits so that "10am" and "50eur" read as "10 am" and "50 eur"
    spaced = re.sub(r"(?<=\d)(?=[^\W\d_])|(?<=[^\W\d_])(?=\d)", " ", prepared)
    words = [w for w in _WORD_RE.findall(spaced)]
    word_set = set(words)

    negations = sum(1 for w in words if w in NEGATIONS_EN or w.endswith("n't"))
    # "I have yet to get my PIN" says what "I haven't got my PIN" says
    negations += sum(1 for w, nxt in itertools.pairwise(words) if w == "yet" and nxt == "to")
    # the Chinese lists are matched as substrings: only worth it when there is a Han character
    masked_zh = ""
    if _HAN_RE.search(prepared) is not None:
        free_zh = prepared
        for word in NEGATION_FREE_ZH:
            if word in free_zh:
                free_zh = free_zh.replace(word, " ")
        negations += sum(1 for ch in free_zh if ch in NEGATIONS_ZH)
        masked_zh = _mask_zh(free_zh)

    actions: set[str] = set()
    for w in words:
        actions.update(_ACTION_LEXICON.get(w, ()))
    if masked_zh:
        for a, b in OPPOSITE_ACTIONS_ZH:
            actions.update(x for x in (a, b) if x in masked_zh)

    poles: set[tuple[int, int]] = set()
    for w in word_set:
        poles.update(_POLE_LEXICON.get(w, ()))
    if masked_zh:
        for k, pair in enumerate(_ANTONYM_PAIRS_ZH):
            poles.update((_ZH_OFFSET + k, side) for side, x in enumerate(pair) if x in masked_zh)

    # dates like 3/4/2024 stay one token (3/4/2024 is not 4/3/2024); other numbers form a multiset
    numbers = [_canonical_date(d) for d in _DATE_RE.findall(prepared)]
    numbers += [_canonical_number(n) for n in _NUMBER_RE.findall(_DATE_RE.sub(" ", prepared))]
    numbers += [NUMBER_WORDS[w] for w in words if w in NUMBER_WORDS]
    numbers += ["zh:" + run for run in _ZH_NUMERAL_RE.findall(prepared)]
    # "two times" is "twice": a count of times reads as a multiple
    for token in _TIMES_RE.findall(spaced):
        value = NUMBER_WORDS.get(token) or (_canonical_number(token) if token.isdigit() else None)
        if value is not None and value in numbers:
            numbers.remove(value)
            numbers.append("x" + value)

    currencies = {CURRENCIES[w] for w in words if w in CURRENCIES}
    currencies |= {CURRENCIES[ch] for ch in prepared if ch in CURRENCIES}
    if not prepared.isascii():
        currencies |= {code for key, code in _NON_ASCII_CURRENCIES if key in prepared}
    currencies |= {code for key, code in _SPACED_CURRENCIES if key in prepared}
    currencies |= {
        "symbol:" + ch for ch in prepared if unicodedata.category(ch) == "Sc" and ch not in CURRENCIES
    }

    dates = {DATE_WORDS[w] for w in words if w in DATE_WORDS}
    if not prepared.isascii():
        dates |= {name for key, name in _NON_ASCII_DATES if key in prepared}
    dates |= {"weekday:" + d for d in _ZH_WEEKDAY_RE.findall(prepared)}

    refs = {"masked:" + m for m in _MASKED_RE.findall(prepared)}
    refs |= {t for t in _TOKEN_RE.findall(prepared) if _is_reference(t)}

    sources = set()
    for i, w in enumerate(words):
        if w == "from":
            rest = [x for x in words[i + 1 : i + 4] if x not in DETERMINERS]
            if rest:
                sources.add(rest[0])

    problem = negations > 0 or not word_set.isdisjoint(PROBLEM_WORDS_EN)
    if masked_zh and not problem:
        problem = any(w in prepared for w in PROBLEM_WORDS_ZH)
    return GuardFeatures(
        negations=negations,
        actions=frozenset(actions),
        weak=frozenset(
            w
            for i, w in enumerate(words)
            if w in _WEAK_WORDS and not (w == "to" and i > 0 and words[i - 1] in INFINITIVE_GOVERNORS)
        ),
        numbers=tuple(sorted(numbers)),
        currencies=frozenset(currencies),
        dates=frozenset(dates),
        refs=frozenset(refs),
        sources=frozenset(sources),
        poles=frozenset(poles),
        words=frozenset(word_set),
        reports_problem=problem,
        rest=remainder,
    )


#: the guard's features of a text; cached, since a leader is compared many times
features: TextCache[GuardFeatures] = TextCache(_features, FEATURES_CACHE, FEATURES_CACHE_BYTES)


def _weak_conflict(a: frozenset[str], b: frozenset[str]) -> tuple[str, str] | None:
    """The first weak pair that ``a`` and ``b`` take opposite sides of, in a fixed order."""
    for x, y in WEAK_OPPOSITES:
        if (x in a and y not in a and y in b and x not in b) or (
            y in a and x not in a and x in b and y not in b
        ):
            return (x, y)
    return None


def _pole_conflict(a: frozenset[tuple[int, int]], b: frozenset[tuple[int, int]]) -> str | None:
    """The first antonym pair that ``a`` and ``b`` take opposite sides of, named symmetrically."""
    for k, side in sorted(a - b):
        other = (k, 1 - side)
        if other in b and other not in a:
            pair = _ANTONYM_PAIRS_EN[k] if k < _ZH_OFFSET else _ANTONYM_PAIRS_ZH[k - _ZH_OFFSET]
            return "/".join(pair)
    return None


def _prefix_negated(a: frozenset[str], b: frozenset[str]) -> str | None:
    """A word of one text that the other text has only with a negating prefix (or -ful vs -less)."""
    for x, y in ((a, b), (b, a)):
        for word in sorted(y - x):
            if word in PREFIX_FALSE_FRIENDS:
                continue
            if word.startswith(NEGATING_PREFIXES):
                for prefix in NEGATING_PREFIXES:
                    base = word[len(prefix) :]
                    if word.startswith(prefix) and len(base) >= 4 and base in x and base not in y:
                        return f"{base}/{word}"
            if word.endswith("less") and word[:-4] + "ful" in x and word[:-4] + "ful" not in y:
                return f"{word[:-4]}ful/{word}"
    return None


def _action_conflict(a: frozenset[str], b: frozenset[str]) -> tuple[str, str] | None:
    """An opposite-action pair that one text takes one side of and the other text the other side."""
    for x, y in OPPOSITE_ACTIONS + OPPOSITE_ACTIONS_ZH:
        if (x in a and y not in a and y in b and x not in b) or (
            y in a and x not in a and x in b and y not in b
        ):
            return (x, y)
    return None


def compatible(fa: GuardFeatures, fb: GuardFeatures, strict: bool = True) -> tuple[bool, str | None]:
    """Compare two texts' features; ``(False, reason)`` on the first difference that changes meaning.

    ``strict``: an action word of :data:`OPPOSITE_ACTIONS` that only one text names vetoes too;
    otherwise only an action and its opposite do. The reason names what differs without saying which
    side had it, so it is symmetric too.
    """
    if fa.rest != fb.rest:
        return False, f"texts differ past the first {GUARD_TEXT_CHARS} characters"
    if fa.negations != fb.negations:
        return False, "negation differs"
    if fa.reports_problem != fb.reports_problem:
        return False, "one reports a problem, the other does not"
    if strict and fa.actions != fb.actions:
        return False, "opposite actions: " + "/".join(sorted(fa.actions ^ fb.actions))
    if not strict:
        conflict = _action_conflict(fa.actions, fb.actions)
        if conflict is not None:
            return False, "opposite actions: " + "/".join(conflict)
    weak = _weak_conflict(fa.weak, fb.weak)
    if weak is not None:
        return False, "opposite words: " + "/".join(weak)
    antonym = _pole_conflict(fa.poles, fb.poles)
    if antonym is not None:
        return False, "antonyms: " + antonym
    prefixed = _prefix_negated(fa.words, fb.words)
    if prefixed is not None:
        return False, "negated by prefix: " + prefixed
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

    The strict guard of the plain threshold rule (:class:`pipeline.pairs.ThresholdDecision`);
    symmetric in ``a`` and ``b``.
    """
    return compatible(features(a), features(b), strict=True)


def hard_conflict(a: str, b: str) -> str | None:
    """Why ``a`` and ``b`` must never share an answer, or None: the guard without the one-sided
    action rule. Used by the learned decision (:class:`pipeline.pairs.LearnedDecision`)."""
    allowed, reason = compatible(features(a), features(b), strict=False)
    return None if allowed else reason


def action_asymmetry(a: str, b: str) -> int:
    """How many words of :data:`OPPOSITE_ACTIONS` only one of the texts names (a learned feature)."""
    return len(features(a).actions ^ features(b).actions)
