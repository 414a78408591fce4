// JsonWriter: the exact bytes ptk's sidecars, plans and headers get, and that they parse back.
#include "common/json_writer.h"

#include <gtest/gtest.h>
#include <simdjson.h>

#include <cmath>
#include <string>

namespace ptk {
namespace {

TEST(JsonWriterTest, SeparatorsAndTypesAsPythonJsonDumps) {
  JsonWriter w;
  w.BeginObject()
      .Field("a", 1)
      .Field("b", -2L)
      .Field("c", uint64_t{18446744073709551615ull})
      .Field("d", 3.0)
      .Field("e", 0.1)
      .Field("f", true)
      .Field("g", "x")
      .Key("h")
      .BeginArray()
      .EndArray()
      .Key("i")
      .BeginObject()
      .EndObject()
      .Key("j")
      .Raw("[1, 2]")
      .EndObject();
  EXPECT_EQ(w.str(),
            R"({"a": 1, "b": -2, "c": 18446744073709551615, "d": 3.0, "e": 0.1, "f": true, "g": "x", "h": [], )"
            R"("i": {}, "j": [1, 2]})");
}

TEST(JsonWriterTest, StringsAreEscapedAndParseBack) {
  const std::string nasty = std::string("quote \" backslash \\ newline \n tab \t nul ") + '\0' + " \x1f utf8 \xc3\xa9";
  JsonWriter w;
  w.BeginArray().Value(nasty).Value(std::string_view("k\"ey")).EndArray();
  EXPECT_EQ(w.str().find('\n'), std::string::npos);
  simdjson::dom::parser p;
  simdjson::dom::array a;
  ASSERT_FALSE(p.parse(w.str()).get(a)) << w.str();
  std::string_view got;
  ASSERT_FALSE(a.at(0).get(got));
  EXPECT_EQ(std::string(got), nasty);
  ASSERT_FALSE(a.at(1).get(got));
  EXPECT_EQ(std::string(got), "k\"ey");
}

TEST(JsonWriterTest, OnePerLineArrays) {
  JsonWriter w;
  w.BeginObject().Field("v", 1).Key("chunks").BeginArray(/*one_per_line=*/true);
  for (int i = 0; i < 2; ++i)
    w.BeginObject().Field("n", i).Key("in").BeginArray().Value(i).Value(i).EndArray().EndObject();
  w.EndArray().EndObject();
  EXPECT_EQ(w.str(), "{\"v\": 1, \"chunks\": [\n  {\"n\": 0, \"in\": [0, 0]},\n  {\"n\": 1, \"in\": [1, 1]}\n]}");
  JsonWriter empty;
  empty.BeginArray(true).EndArray();
  EXPECT_EQ(empty.str(), "[\n]");
}

}  // namespace
}  // namespace ptk
