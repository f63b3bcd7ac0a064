"""Two questions that are the same words but one, where one says a word and the other its opposite or a sibling of
its closed class, ask different things: "sort in ascending order" / "in descending order", "如何降低血压" /
"如何升高血压", "左眼皮跳" / "右眼皮跳", "translate it into French" / "into Spanish". The cross-encoder sees every
other word shared and scored the first two like paraphrases (decision score 5.9-6.2, served at a 5% bound), so the
second stage rules such pairs out before it reads them. Any other rewording is left to the model.

The classes are general vocabulary (directions, opposites, weekdays, months, colours, languages, units, numbers,
measures); a member written "a|b" is one meaning spelled two ways ("km|kilometers"), never a contrast with itself.
The training generator (server/tuning/hard_negatives.py, kind ``contrast``) draws its replacements from EN_CLASSES
and ZH_CLASSES; the rule reads those and _RULE_ONLY_CLASSES.
"""
from __future__ import annotations

import functools

from .transposition import tokens

# English words, matched whole and case-folded.
EN_CLASSES = (
    "left right", "up down", "north south", "east west", "increase decrease", "increasing decreasing",
    "higher lower", "highest lowest", "largest smallest", "biggest smallest", "maximum minimum", "max min",
    "first last", "before after", "buy sell", "buying selling", "import export", "install uninstall",
    "enable disable", "upload download", "encrypt decrypt", "compress decompress", "encode decode", "push pull",
    "add remove", "start stop", "open close", "men women", "male female", "boy girl", "boys girls", "hot cold",
    "best worst", "fastest slowest", "morning evening", "day night", "ascending descending", "uppercase lowercase",
    "horizontal vertical", "row column", "rows columns", "input output", "positive negative", "odd even",
    "advantages disadvantages", "pros cons", "win lose", "summer winter spring autumn|fall",
    "monday tuesday wednesday thursday friday saturday sunday",
    "january february march april june july august september october november december",
    "red green blue yellow black white orange purple pink",
    "english french spanish german italian portuguese russian chinese japanese korean arabic",
    "python java javascript typescript ruby php rust kotlin swift",
    "km|kilometers|kilometres miles meters|metres feet inches", "kg|kilograms pounds|lb|lbs grams ounces",
    "celsius fahrenheit kelvin",
)
# Chinese words (two characters or more, or a character that cannot sit inside another word with its sibling).
ZH_CLASSES = (
    "增加 减少", "提高|升高 降低", "上升 下降", "上涨 下跌", "开通 关闭", "开启 关闭", "打开 关闭", "存款 取款", "存入 取出",
    "转入 转出", "买入 卖出", "购买 出售", "借款 还款", "收入 支出", "优点 缺点", "好处 坏处", "成功 失败", "开机 关机",
    "登录 退出", "下载 上传", "安装 卸载", "结婚 离婚", "最大 最小", "最高 最低", "最多 最少", "最早 最晚", "最快 最慢",
    "上午 下午", "早上 晚上", "春天 夏天 秋天 冬天", "男生 女生", "男人 女人", "男性 女性", "男孩 女孩",
    "男朋友 女朋友", "老公 老婆", "爸爸 妈妈", "父亲 母亲", "儿子 女儿", "哥哥 姐姐 弟弟 妹妹", "左眼 右眼", "左手 右手",
    "左脚 右脚", "左边 右边", "左侧 右侧", "左耳 右耳", "南方 北方", "冷水 热水", "上个月 下个月", "上周 下周",
    "去年 今年 明年", "昨天 今天 明天", "前天 后天", "以前 以后", "之前 之后", "输入 输出", "正数 负数", "奇数 偶数",
    "小学 初中 高中 大学", "一年级 二年级 三年级 四年级 五年级 六年级", "星期一 星期二 星期三 星期四 星期五 星期六 星期日",
    "周一 周二 周三 周四 周五 周六 周日", "红色 蓝色 绿色 黄色 黑色 白色 紫色", "中文 英文 日文",
    "汉语 英语 日语 韩语 法语 德语", "信用卡 储蓄卡", "苹果手机 安卓手机",
)
# Read by the rule only: single ideographs sit inside other words, so the training generator (which replaces
# substrings) would make nonsense of them, and the English opposites came after its runs (docs/semantic-quality.md).
_RULE_ONLY_CLASSES = (
    "soft hard", "under over", "above below", "with without", "more less", "fast slow", "faster slower",
    "cheap expensive", "new old", "newer older", "large|big small",
    "long short", "high low", "heavy light", "early late", "light dark", "full empty", "inside outside",
    "true false", "cause|reason effect|consequence|result", "symptom cause treatment|cure", "benefit risk|danger",
    "why how where when who", "all|every any|some most none|no",
    "bigger|larger smaller longer shorter wider narrower taller deeper shallower heavier lighter older younger "
    "stronger weaker better worse hotter colder",
    "biggest|largest smallest longest shortest widest tallest deepest heaviest lightest oldest youngest strongest "
    "weakest",
    "read write", "serialize deserialize", "create delete", "bind unbind", "lock unlock", "mount unmount",
    "zip unzip", "follow unfollow", "subscribe unsubscribe", "block unblock", "connect disconnect",
    "activate deactivate", "freeze unfreeze",
    "son daughter", "wife husband", "brother sister", "mom|mother dad|father", "grandmother grandfather",
    "aunt uncle", "niece nephew", "boyfriend girlfriend", "dog cat rabbit hamster horse",
    "windows mac|macos linux", "ios android", "iphone android",
    "绑定 解绑", "还款日 账单日", "转账 取现|提现", "设置 修改",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
    "eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand million billion",
    "first second third fourth fifth sixth seventh eighth ninth tenth", "i ii iii iv v vi vii viii ix x",
    "weight height length|distance width depth age population area volume speed|velocity temperature price|cost",
    "零 一 二|两 三 四 五 六 七 八 九 十",    # not 百 千 万: 千万 / 万万, 十分 / 万分 are adverbs
    "快 慢", "大 小", "多 少", "高 低", "长 短", "冷 热", "新 旧", "早 晚", "胖 瘦", "涨 跌", "增 减", "买 卖", "开 关",
    "进 出", "前 后", "左 右", "东 西", "南 北", "男 女", "上 下", "加 减", "正 反", "内 外", "远 近", "软 硬", "真 假",
    "好 坏",
)
_SLACK = 3      # how far a contrast word may reach into the shared words around it ("星期一" / "星期二": 星期 is shared)


def siblings(classes: tuple[str, ...]) -> dict[str, list[str]]:
    """Each word -> the words of the other members of its classes (a member's spellings are not its siblings)."""
    out: dict[str, list[str]] = {}
    for members in classes:
        spelled = [member.split("|") for member in members.split()]
        for i, member in enumerate(spelled):
            others = [w for j, other in enumerate(spelled) if j != i for w in other]
            for w in member:
                out.setdefault(w, []).extend(others)
    return out


@functools.cache
def _contrasts() -> dict[tuple[str, ...], frozenset[tuple[str, ...]]]:
    """The classes as the rule reads text: token tuples (transposition.tokens: folded words, single ideographs)."""
    out: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for word, others in siblings(EN_CLASSES + ZH_CLASSES + _RULE_ONLY_CLASSES).items():
        out.setdefault(tuple(tokens(word)), set()).update(tuple(tokens(o)) for o in others)
    return {k: frozenset(v - {k}) for k, v in out.items()}


def contrasted(a: str, b: str) -> bool:
    """Whether the two texts differ in one place only, where one holds a word and the other its sibling."""
    ta, tb = tokens(a), tokens(b)
    if ta == tb:
        return False
    shortest = min(len(ta), len(tb))
    prefix = next((i for i in range(shortest) if ta[i] != tb[i]), shortest)
    suffix = next((i for i in range(shortest - prefix) if ta[-1 - i] != tb[-1 - i]), shortest - prefix)
    table = _contrasts()
    for left in range(min(prefix, _SLACK) + 1):
        for right in range(min(suffix, _SLACK) + 1):
            wa = tuple(ta[prefix - left:len(ta) - suffix + right])
            wb = tuple(tb[prefix - left:len(tb) - suffix + right])
            if wb in table.get(wa, ()):
                return True
    return False
