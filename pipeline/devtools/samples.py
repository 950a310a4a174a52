"""Sample customer questions for the demo, written for this project (no data-set sentences)."""

from __future__ import annotations

QUESTIONS: tuple[str, ...] = (
    "My new card still hasn't arrived, how long does delivery take?",
    "How do I activate the card you sent me?",
    "I think my card was stolen, what should I do?",
    "Can I freeze my card from the app?",
    "Why was I charged a fee for taking out cash?",
    "The ATM kept my card, how do I get it back?",
    "How long does a transfer to another bank take?",
    "My transfer hasn't reached my friend yet, why?",
    "What exchange rate do you use for payments abroad?",
    "I was charged twice for the same purchase.",
    "How do I top up my account with a bank transfer?",
    "Is there a limit on how much I can top up?",
    "How can I change my PIN?",
    "My PIN is blocked after too many tries.",
    "Can I get a refund for something I bought online?",
    "Which currencies can I hold in my account?",
    "How do I verify my identity?",
    "Why is my payment still pending?",
    "I don't recognise a payment on my statement.",
    "Can I have a virtual card for online shopping?",
    "How do I close my account?",
    "Do you support Apple Pay and Google Pay?",
    "What should I do if I forgot my passcode?",
    "How do I change my home address?",
    "Why did my card payment get declined?",
    "Can I send money to someone in another country?",
    "How do I get a physical card as well as a virtual one?",
    "Is there a fee for exchanging currency?",
    "How old do I need to be to open an account?",
    "My salary hasn't shown up in my account yet.",
)

#: light edits a user might make when asking again (the dedup and cache should catch these)
REPHRASINGS: tuple[tuple[str, str], ...] = (
    (
        "My new card still hasn't arrived, how long does delivery take?",
        "my new card still hasnt arrived - how long does delivery take",
    ),
    ("How can I change my PIN?", "Hi, how can I change my PIN please?"),
    ("I think my card was stolen, what should I do?", "I think my card has been stolen. What should I do?"),
    ("Why did my card payment get declined?", "why did my card payment get declined??"),
)

USERS: tuple[str, ...] = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")
