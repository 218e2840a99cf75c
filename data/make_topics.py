"""Write the course's topic-classification set: shardlib/data/topics/{train,validation,test}.jsonl.

Run by hand (`python data/make_topics.py`); the output is committed, so nothing runs at
lesson time. Each line is {"text": ..., "label": ...} with one of five topics.

How the splits are kept apart: every topic has three template banks (train, validation,
test) and two filler banks (train, test). Training sentences come from the train
templates and train fillers only; test sentences from the test templates and test
fillers only, so no test sentence shares a template or a filler phrase with training.
Validation uses its own templates with the training fillers. About a third of all
sentences carry a clause about another topic (a distractor), so that a bag of topic
words is not enough to label them.

Everything here was written for this course (CC BY 4.0, see data/README.md).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 2024
COUNTS = {"train": 200, "validation": 40, "test": 80}  # sentences per topic and split
DISTRACTOR_RATE = 0.35
OUT_DIR = Path(__file__).resolve().parents[1] / "shardlib" / "data" / "topics"  # shipped inside the package

# Per topic: templates with {who} and {what} slots, one bank per split; fillers for the
# slots, one bank for train+validation and one for test.
TOPICS: dict[str, dict[str, list[str]]] = {
    "sport": {
        "train_templates": [
            "{who} scored twice in {what}.",
            "{who} was sent off early in {what}.",
            "The crowd cheered when {who} won {what}.",
            "{who} trained every morning before {what}.",
            "After {what}, {who} thanked the travelling fans.",
            "{who} missed a penalty late in {what}.",
            "Tickets for {what} sold out, and {who} promised a big performance.",
            "{who} set a new personal best during {what}.",
            "The commentators praised {who} after {what}.",
            "{who} injured an ankle in the warm-up for {what}.",
            "Everyone agreed that {who} deserved to win {what}.",
            "{who} was substituted at half time in {what}.",
        ],
        "validation_templates": [
            "With one minute left in {what}, {who} equalised.",
            "{who} celebrated wildly at the end of {what}.",
            "The manager dropped {who} for {what}.",
            "{who} looked exhausted after extra time in {what}.",
        ],
        "test_templates": [
            "Nobody expected {who} to lose {what} so heavily.",
            "{who} collected the trophy once {what} was over.",
            "The scoreboard showed {who} leading at the break of {what}.",
            "{who} appealed the decision of the umpire during {what}.",
            "It rained all through {what}, yet {who} never slowed down.",
            "A late goal by {who} decided {what}.",
            "{who} has been suspended for two games after {what}.",
            "Spectators booed when {who} fouled an opponent in {what}.",
        ],
        "train_who": ["the striker", "our goalkeeper", "the captain", "the young sprinter", "the home team",
                      "the tennis champion", "the rugby squad", "the cyclist", "the swimmer", "the point guard",
                      "the winger", "the defender"],
        "train_what": ["the final", "the league match", "the penalty shootout", "the semi-final", "the derby",
                       "the qualifying round", "the time trial", "the cup tie", "the relay heats"],
        "test_who": ["the midfielder", "the veteran boxer", "the visiting side", "the marathon runner",
                     "the pitcher", "the hockey team", "the wrestler"],
        "test_what": ["the championship game", "the playoff", "the grand slam", "the title fight",
                      "the away fixture", "the season opener"],
    },
    "food": {
        "train_templates": [
            "{who} roasted {what} with garlic and rosemary.",
            "{who} burned {what} because the oven was too hot.",
            "The recipe says {who} should simmer {what} for an hour.",
            "{who} seasoned {what} with salt, pepper and lemon.",
            "For dinner {who} served {what} with fresh bread.",
            "{who} forgot to add sugar to {what}.",
            "The smell of {what} brought {who} into the kitchen.",
            "{who} chopped the onions for {what}.",
            "{who} asked for a second helping of {what}.",
            "{who} ate the leftovers of {what} for lunch.",
            "{who} baked {what} for the neighbours.",
            "{who} thinks {what} needs more spice.",
        ],
        "validation_templates": [
            "{who} stirred {what} until it thickened.",
            "After tasting {what}, {who} added a pinch of chilli.",
            "{who} wrote down the recipe for {what}.",
            "{who} froze half of {what} for later.",
        ],
        "test_templates": [
            "The waiter recommended {what}, and {who} loved it.",
            "{who} let {what} marinate overnight in yoghurt.",
            "Once {what} had cooled, {who} sliced it thinly.",
            "{who} grilled {what} over charcoal in the garden.",
            "The cookbook shows {who} how to fold the dough for {what}.",
            "{who} complained that {what} was far too salty.",
            "{who} whisked the eggs before pouring them over {what}.",
            "A bowl of {what} was all {who} wanted after the long day.",
        ],
        "train_who": ["my grandmother", "the chef", "our cook", "my flatmate", "the baker", "the students",
                      "my uncle", "the restaurant owner", "the kids", "the caterer", "my sister"],
        "train_what": ["the vegetable soup", "the chicken", "the apple pie", "the risotto", "the lentil stew",
                       "the pancakes", "the tomato sauce", "the lamb curry", "the chocolate cake"],
        "test_who": ["the pastry cook", "our host", "the new sous-chef", "my cousin", "the diners",
                     "the food critic", "my neighbour"],
        "test_what": ["the mushroom omelette", "the salmon fillet", "the noodle broth", "the lemon tart",
                      "the bean chili", "the flatbread"],
    },
    "health": {
        "train_templates": [
            "{who} prescribed {what} for the infection.",
            "{who} has been taking {what} twice a day.",
            "The nurse told {who} to stop {what} for a week.",
            "{who} felt dizzy after starting {what}.",
            "{who} booked an appointment to discuss {what}.",
            "According to the doctor, {who} must keep up {what}.",
            "{who} recovered quickly thanks to {what}.",
            "The clinic offered {who} {what} free of charge.",
            "{who} read the side effects listed for {what}.",
            "{who} asked the pharmacist about {what}.",
            "The hospital moved {who} onto {what}.",
            "{who} was advised that {what} lowers blood pressure.",
        ],
        "validation_templates": [
            "{who} had a blood test before beginning {what}.",
            "The surgeon explained to {who} why {what} was needed.",
            "{who} noticed a rash a day after {what}.",
            "{who} is waiting for the results of {what}.",
        ],
        "test_templates": [
            "The specialist warned {who} that {what} could cause drowsiness.",
            "{who} skipped {what} and the fever came back.",
            "After a week of {what}, {who} could breathe easily again.",
            "{who} needed stitches first and {what} afterwards.",
            "The midwife checked on {who} during {what}.",
            "{who} filled in a form about allergies before {what}.",
            "The symptoms of {who} improved once {what} began.",
            "{who} asked whether {what} was safe during pregnancy.",
        ],
        "train_who": ["the patient", "my father", "the doctor", "the elderly man", "my colleague",
                      "the physiotherapist", "our daughter", "the diabetic woman", "the nurse", "my aunt"],
        "train_what": ["the antibiotics", "the physiotherapy", "the vaccine", "the insulin injections",
                       "the blood thinners", "the painkillers", "the allergy tablets", "the cough syrup"],
        "test_who": ["the toddler", "the pharmacist", "the injured hiker", "my grandfather",
                     "the pregnant teacher", "the asthmatic boy"],
        "test_what": ["the inhaler treatment", "the course of steroids", "the x-ray",
                      "the flu jab", "the eye drops", "the dialysis sessions"],
    },
    "technology": {
        "train_templates": [
            "{who} installed {what} on the old laptop.",
            "{who} found a bug in {what}.",
            "After the update, {what} crashed whenever {who} logged in.",
            "{who} wrote a script to back up {what}.",
            "{who} reset the password for {what}.",
            "The battery drained fast while {who} used {what}.",
            "{who} reported that {what} uploads files too slowly.",
            "{who} reinstalled {what} after the hard drive failed.",
            "{who} plugged {what} into the wrong port.",
            "The firmware for {what} was patched by {who}.",
            "{who} connected {what} to the office network.",
            "{who} spent the night debugging {what}.",
        ],
        "validation_templates": [
            "{who} upgraded the memory in {what}.",
            "The screen of {what} froze while {who} was typing.",
            "{who} encrypted the data stored on {what}.",
            "{who} compiled {what} from source.",
        ],
        "test_templates": [
            "{who} paired {what} with the phone over bluetooth.",
            "The server hosting {what} went offline, so {who} restarted it.",
            "{who} downloaded a driver so that {what} would print.",
            "A virus infected {what} before {who} noticed.",
            "{who} configured the router to give {what} a fixed address.",
            "The pixels on {what} flickered until {who} replaced the cable.",
            "{who} benchmarked {what} against the previous model.",
            "{who} synced the calendar on {what} with the cloud.",
        ],
        "train_who": ["the engineer", "the developer", "my brother", "the IT support team", "the programmer",
                      "the system administrator", "the intern", "the gamer", "my manager", "the student"],
        "train_what": ["the database", "the web browser", "the graphics card", "the spreadsheet app",
                       "the email client", "the operating system", "the keyboard", "the USB stick",
                       "the video editor"],
        "test_who": ["the network technician", "the hacker", "the data scientist", "my teenage son",
                     "the software tester", "the web designer"],
        "test_what": ["the tablet", "the smart speaker", "the printer", "the file server",
                      "the game console", "the external monitor"],
    },
    "nature": {
        "train_templates": [
            "{who} spotted {what} near the river bank.",
            "{who} photographed {what} at dawn.",
            "During the storm {who} sheltered beside {what}.",
            "{who} counted {what} on the walk through the woods.",
            "{what} came into view when {who} reached the valley.",
            "{who} followed the tracks of {what} through the snow.",
            "Every spring {who} waits for {what} to return.",
            "{who} planted seeds close to {what}.",
            "{who} heard {what} calling in the forest.",
            "The guide showed {who} where {what} lives.",
            "{who} watched {what} from the cliff top.",
            "{who} found {what} hidden under the leaves.",
        ],
        "validation_templates": [
            "{who} sketched {what} beside the pond.",
            "A thick fog hid {what} from {who}.",
            "{who} recorded the song of {what}.",
            "{who} waded across the stream to reach {what}.",
        ],
        "test_templates": [
            "{who} climbed the ridge and saw {what} in the meadow below.",
            "Frost covered {what} by the time {who} woke up.",
            "{who} kept very still while {what} drank from the lake.",
            "The tide went out, and {who} discovered {what} among the rocks.",
            "{who} measured how much {what} had grown since autumn.",
            "On the night hike {who} noticed {what} glowing faintly.",
            "{who} released {what} back into the wild.",
            "Wildflowers surrounded {what}, which delighted {who}.",
        ],
        "train_who": ["the ranger", "the birdwatcher", "my niece", "the botanist", "the hikers", "the farmer",
                      "the biologist", "our group", "the photographer", "the shepherd"],
        "train_what": ["a family of otters", "the old oak tree", "a herd of deer", "a red fox", "the wild orchids",
                       "a pair of eagles", "the beaver dam", "a swarm of bees", "the mossy boulders"],
        "test_who": ["the ecologist", "the camper", "the park warden", "the naturalist",
                     "my daughter", "the mountaineer"],
        "test_what": ["a hedgehog", "the pine saplings", "a flock of geese", "the starfish",
                      "a badger", "the fireflies"],
    },
}

# Distractor clauses: each one mentions another topic. Keyed by the topic they mention;
# one bank for train+validation, one for test.
DISTRACTORS: dict[str, dict[str, list[str]]] = {
    "sport": {"train": ["while the football was on the radio", "just before the big match started",
                        "wearing a tennis club shirt"],
              "test": ["as the cricket scores came in", "still sore from the swimming lesson"]},
    "food": {"train": ["while a pizza was baking downstairs", "after a quick sandwich",
                       "with a cup of tea going cold nearby"],
             "test": ["while the soup was reheating", "smelling of fried onions"]},
    "health": {"train": ["despite a bad cold", "on the way back from the dentist",
                         "with a bandaged wrist"],
               "test": ["still recovering from the flu", "after a check-up at the surgery"]},
    "technology": {"train": ["while the phone kept buzzing", "between two video calls",
                             "with a laptop open on the table"],
                   "test": ["as the tablet charged in the corner", "while the wifi kept dropping"]},
    "nature": {"train": ["while the birds sang outside", "as it started to snow",
                         "under a huge oak tree"],
               "test": ["as the wind shook the pine trees", "while a robin watched from the fence"]},
}

SPLIT_BANKS = {"train": ("train_templates", "train"), "validation": ("validation_templates", "train"),
               "test": ("test_templates", "test")}


def add_distractor(sentence: str, clause: str, rng: random.Random) -> str:
    """Put the distractor clause before or after the main sentence."""
    body = sentence.rstrip(".")
    if rng.random() < 0.5:
        return f"{clause[0].upper()}{clause[1:]}, {body[0].lower()}{body[1:]}."
    return f"{body}, {clause}."


def make_split(split: str, rng: random.Random) -> list[dict]:
    template_key, filler_side = SPLIT_BANKS[split]
    rows = []
    for topic, bank in TOPICS.items():
        others = [t for t in TOPICS if t != topic]
        seen: set[str] = set()
        while len(seen) < COUNTS[split]:
            template = rng.choice(bank[template_key])
            text = template.format(who=rng.choice(bank[f"{filler_side}_who"]),
                                   what=rng.choice(bank[f"{filler_side}_what"]))
            text = text[0].upper() + text[1:]
            if rng.random() < DISTRACTOR_RATE:
                clause_side = "test" if split == "test" else "train"
                text = add_distractor(text, rng.choice(DISTRACTORS[rng.choice(others)][clause_side]), rng)
            if text not in seen:
                seen.add(text)
                rows.append({"text": text, "label": topic})
    rng.shuffle(rows)
    return rows


def main() -> None:
    rng = random.Random(SEED)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for split in ("train", "validation", "test"):
        rows = make_split(split, rng)
        with open(OUT_DIR / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"wrote {len(rows)} rows to {OUT_DIR / (split + '.jsonl')}")


if __name__ == "__main__":
    main()
