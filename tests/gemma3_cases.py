"""Shared by the Gemma 3 270M real-model tests (tests/models/test_gemma3.py,
tests/parallel/test_sharding.py): the long prompt and the logit tolerance against HF."""

# Measured max |ours - HF| at the last position: short prompt (6 tokens)
# 2.8e-5, long prompt (650 tokens) 7.0e-5, with max |logit| 22 and 24;
# the bound (about 1.2e-3 here) leaves >10x headroom.
LOGIT_ATOL, LOGIT_RTOL = 1e-3, 1e-5

# Natural text, ~650 tokens, longer than the 512-token window.
LONG_PARAGRAPHS = [
    "The river town of Alder Bend grew up where the old trade road crossed the water. In the "
    "spring the river rose over the low meadows, and the farmers moved their sheep to the hills "
    "above the mill. Every family kept a boat, and children learned to row before they could read.",
    "The mill was the largest building in town. Its wheel turned day and night from March to "
    "November, grinding wheat from the valley farms into flour that was carried by cart to the "
    "markets in the city. The miller, a tall woman named Mara Quill, kept careful books: every "
    "sack that came in and every sack that went out was written down in a brown leather ledger.",
    "In the winter the river froze near the banks, and the town held a fair on the ice. There were "
    "stalls selling roasted chestnuts, hot cider and woollen gloves, and a band played from a "
    "wooden stage that was pulled onto the ice by two horses. The bravest skaters raced from the "
    "mill to the stone bridge and back, and the winner received a silver spoon.",
    "The school stood on the hill behind the church. It had one room, two windows and a stove "
    "that smoked whenever the wind blew from the north. The teacher, Mr. Evan Hale, taught "
    "reading, arithmetic, geography and a little history, and on Fridays he read aloud from "
    "books of travel: deserts, jungles, frozen seas and cities with towers of glass.",
    "Trade brought news as well as goods. Merchants told stories of new machines in the factories "
    "of the south, of railways that could carry a thousand sacks of flour in a single day, and of "
    "telegraph wires that sent messages faster than any horse. Some people in Alder Bend were "
    "excited by these stories; others were afraid that the mill and the boats would no longer "
    "be needed.",
    "When the surveyors finally came to plan the railway, they chose a route along the eastern "
    "bank, close to the mill. Mara Quill walked out to meet them with her ledger under her arm. "
    "She showed them how much flour the town produced each year, how many carts travelled the "
    "old road, and how many boats carried goods down the river to the sea.",
    "The surveyors were impressed. They promised a station at Alder Bend, with a wooden platform, "
    "a water tower for the engines and a small warehouse for the flour. Building the line took "
    "three summers. Men from the town worked on it for wages, and the carpenters built the "
    "platform from oak that was cut in the forest above the school.",
    "On the day the first train arrived, the whole town gathered at the station. The engine "
    "came around the bend with a long whistle and a cloud of white steam, and the children "
    "cheered so loudly that the horses in the field began to run. Mr. Hale said that it was "
    "the most important day in the history of the town, and he asked every pupil to write "
    "an essay about it.",
    "Years later, when the mill had closed and the boats were used only for fishing, people "
    "still told the story of that morning. They remembered the smell of the steam, the sound "
    "of the whistle and the sight of Mara Quill standing on the platform with her ledger, "
    "counting the sacks of flour as they were loaded onto the first train. In the end,",
]
LONG = "\n\n".join(LONG_PARAGRAPHS)
