// ptrain-test: np=1,2,4 labels=quick timeout=120
// The deck: namelist grammar, errors with file:line:col, --set overrides, cross-field
// validation, the echo round trip, and the MPI load (same Config or same error everywhere).
#include <dirent.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>

#include "deck/deck.hpp"
#include "test_support.hpp"
#include "util/error.hpp"

using namespace ptrain;

using ptrain::test::world_rank;
using ptrain::test::world_size;

namespace {

// The message of the Error that fn throws (and that its exit code is 2), or "no error".
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), kExitInput) << e.what();
    return e.what();
  }
  return "no error";
}

std::string parse_error(const std::string& text) {
  return error_of([&] { deck::parse_text(text, "deck.nml"); });
}

std::string set_error(const std::vector<std::string>& overrides) {
  return error_of([&] { deck::parse_text("", "deck.nml", overrides); });
}

bool bits_equal(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// parallel%order after reading "&parallel <items> /".
std::vector<std::string> order_of(const std::string& items) {
  return deck::parse_text("&parallel " + items + " /", "a.nml").parallel.order;
}

std::string bcast_string(std::string s) {
  long long n = static_cast<long long>(s.size());
  MPI_Bcast(&n, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  s.resize(static_cast<std::size_t>(n));
  MPI_Bcast(s.data(), static_cast<int>(n), MPI_CHAR, 0, MPI_COMM_WORLD);
  return s;
}

// A scratch folder made by rank 0 and known to every rank.
std::string shared_temp_dir() {
  std::string dir;
  if (world_rank() == 0) {
    char tmpl[] = "/tmp/ptrain_test_deck_XXXXXX";
    dir = mkdtemp(tmpl) ? tmpl : "";
  }
  return bcast_string(dir);
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

}  // namespace

// --- the table -------------------------------------------------------------------

TEST(DeckSchema, TableHasEveryKeyOfSchemaDef) {
  // Independent count: the PTRAIN_KEY lines of the file itself.
  std::ifstream f(PTRAIN_SOURCE_DIR "/src/deck/schema.def");
  ASSERT_TRUE(f.good());
  std::string line;
  std::size_t keys = 0, groups = 0;
  while (std::getline(f, line)) {
    if (line.rfind("PTRAIN_KEY(", 0) == 0) ++keys;
    if (line.rfind("PTRAIN_GROUP_BEGIN(", 0) == 0) ++groups;
  }
  EXPECT_EQ(deck::key_specs().size(), keys);
  EXPECT_EQ(deck::group_specs().size(), groups);
  std::size_t in_groups = 0;
  for (const auto& g : deck::group_specs()) in_groups += g.keys.size();
  EXPECT_EQ(in_groups, keys);
  const auto& order = deck::key_specs()[static_cast<std::size_t>(deck::group_specs()[2].keys[7])];
  EXPECT_EQ(order.name(), "parallel%order");
  EXPECT_EQ(order.type, deck::KeyType::Str);
  EXPECT_EQ(order.extent, 5);
  EXPECT_EQ(order.choices, (std::vector<std::string>{"t", "c", "e", "d", "p"}));
}

TEST(DeckSchema, DefaultsAreReadFromTheTable) {
  Config c = deck::defaults();
  EXPECT_EQ(c.run.name, "ptrain");
  EXPECT_EQ(c.run.seed, 1234);
  EXPECT_FALSE(c.run.trace);
  EXPECT_EQ(c.model.n_layer, 4);
  EXPECT_EQ(c.model.init_from, "");
  EXPECT_TRUE(bits_equal(c.model.capacity_factor, 1.25));
  EXPECT_EQ(c.parallel.dp, -1);
  EXPECT_EQ(c.parallel.order, (std::vector<std::string>{"t", "c", "e", "d", "p"}));
  EXPECT_TRUE(bits_equal(c.train.lr, 3e-4));
  EXPECT_TRUE(bits_equal(c.train.eps, 1e-8));
  EXPECT_TRUE(bits_equal(c.parallel.bucket_mb, 25.0));
  EXPECT_EQ(c.backend.device, "cpu");
  // An empty deck is the defaults.
  Config e = deck::parse_text("", "empty.nml");
  EXPECT_TRUE(deck::same_values(c, e));
  EXPECT_EQ(e.deck_path, "empty.nml");
}

// --- the grammar -----------------------------------------------------------------

TEST(DeckGrammar, F90nmlStyle) {
  Config c = deck::parse_text(
      "&model\n    n_layer = 6\n    dtype = 'fp64'\n    capacity_factor = 1.5\n/\n"
      "&parallel\n    order = 'd', 't', 'c', 'e', 'p'\n    sequence_parallel = .true.\n/\n",
      "f.nml");
  EXPECT_EQ(c.model.n_layer, 6);
  EXPECT_EQ(c.model.dtype, "fp64");
  EXPECT_EQ(c.model.capacity_factor, 1.5);
  EXPECT_EQ(c.parallel.order, (std::vector<std::string>{"d", "t", "c", "e", "p"}));
  EXPECT_TRUE(c.parallel.sequence_parallel);
}

TEST(DeckGrammar, RealForms) {
  Config c = deck::parse_text(
      "&train lr = 1.0d-3, min_lr=1.D0 , beta1 = .5 ! comment\n"
      "   beta2=+9.5e-1\n"
      "   weight_decay = 2   eps = 1E-12\n"
      "   clip = 3.\n"
      "&end\n",
      "r.nml");
  EXPECT_TRUE(bits_equal(c.train.lr, 1.0e-3));
  EXPECT_TRUE(bits_equal(c.train.min_lr, 1.0));
  EXPECT_TRUE(bits_equal(c.train.beta1, 0.5));
  EXPECT_TRUE(bits_equal(c.train.beta2, 0.95));
  EXPECT_TRUE(bits_equal(c.train.weight_decay, 2.0));
  EXPECT_TRUE(bits_equal(c.train.eps, 1e-12));
  EXPECT_TRUE(bits_equal(c.train.clip, 3.0));
  Config n = deck::parse_text("&model capacity_factor = -0.0 /", "n.nml");
  EXPECT_TRUE(std::signbit(n.model.capacity_factor));
}

TEST(DeckGrammar, NamesAreCaseInsensitiveAndGroupsInAnyOrder) {
  Config c = deck::parse_text(
      "&BACKEND DEVICE='cpu', Blas_Threads=+3 /\n"
      "&Model N_LAYER = 8 /\n"
      "&run steps=-0 /\n",
      "c.nml");
  EXPECT_EQ(c.backend.blas_threads, 3);
  EXPECT_EQ(c.model.n_layer, 8);
  EXPECT_EQ(c.run.steps, 0);
}

TEST(DeckGrammar, Logicals) {
  const std::vector<std::pair<std::string, bool>> forms = {
      {".true.", true}, {".false.", false}, {"T", true},       {"F", false},
      {".t.", true},    {".f.", false},     {"true", true},    {"false", false},
      {".TRUE.", true}, {"t", true},        {".tomato", true}, {"f", false}};
  for (const auto& [text, want] : forms) {
    // Start from the opposite value so a no-op would be caught.
    Config c = deck::parse_text(
        cat("&run trace = ", text, " /\n&checkpoint save_final=", text, "/"), "l.nml");
    EXPECT_EQ(c.run.trace, want) << text;
    EXPECT_EQ(c.checkpoint.save_final, want) << text;
  }
  Config c = deck::parse_text("&parallel sequence_parallel = t strict_topology = T /", "l.nml");
  EXPECT_TRUE(c.parallel.sequence_parallel);
  EXPECT_TRUE(c.parallel.strict_topology);
}

TEST(DeckGrammar, Strings) {
  Config c = deck::parse_text(
      "&run name = 'it''s', out_dir = \"say \"\"hi\"\" / ! not a comment\" /\n"
      "&data path = '' /\n&model init_from = \"a'b\" /",
      "s.nml");
  EXPECT_EQ(c.run.name, "it's");
  EXPECT_EQ(c.run.out_dir, "say \"hi\" / ! not a comment");
  EXPECT_EQ(c.data.path, "");
  EXPECT_EQ(c.model.init_from, "a'b");
}

TEST(DeckGrammar, ArraysIndicesRepeatsAndNulls) {
  using V = std::vector<std::string>;
  EXPECT_EQ(order_of("order = 'p', 'd', 'e', 'c', 't'"), (V{"p", "d", "e", "c", "t"}));
  EXPECT_EQ(order_of("order = 'p' 'd'\n 'e'\n 'c' 't'"), (V{"p", "d", "e", "c", "t"}));
  EXPECT_EQ(order_of("order(2) = 'd'"), (V{"t", "d", "e", "d", "p"}));
  EXPECT_EQ(order_of("order(4) = 'c', 'c'"), (V{"t", "c", "e", "c", "c"}));
  EXPECT_EQ(order_of("order = 2*'d', 'c'"), (V{"d", "d", "c", "d", "p"}));
  EXPECT_EQ(order_of("order = 5*'e'"), (V{"e", "e", "e", "e", "e"}));
  EXPECT_EQ(order_of("order = , 'p'"), (V{"t", "p", "e", "d", "p"}));
  EXPECT_EQ(order_of("order = 'p', , , 't'"), (V{"p", "c", "e", "t", "p"}));
  EXPECT_EQ(order_of("order = 2*, 'c', 't',"), (V{"t", "c", "c", "t", "p"}));
  EXPECT_EQ(order_of("order = 'p',,,,,,"),
            (V{"p", "c", "e", "d", "p"}));  // trailing nulls, one past the end
  EXPECT_EQ(order_of("order(1) = 'd', order(5) = 't'"), (V{"d", "c", "e", "d", "t"}));
  EXPECT_EQ(order_of("order( 3 ) = 'p'"), (V{"t", "c", "p", "d", "p"}));
  // Repeat counts on numbers; a null scalar leaves the default.
  Config c = deck::parse_text("&model n_layer = 1*6, d_model = , n_head=2 /", "r.nml");
  EXPECT_EQ(c.model.n_layer, 6);
  EXPECT_EQ(c.model.d_model, 128);
  EXPECT_EQ(c.model.n_head, 2);
}

TEST(DeckGrammar, ItemSeparatorsAndTerminators) {
  Config a = deck::parse_text("&model n_layer=2,d_model=64,n_head=8/", "s.nml");
  Config b = deck::parse_text(
      "&model\n  n_layer = 2\n\n  d_model = 64   ! width\n  n_head = 8\n&end\n", "s.nml");
  Config c = deck::parse_text(
      "notes before the deck\n&model n_layer = 2 d_model = 64 , , n_head = 8 &END\nnotes after /\n",
      "s.nml");
  Config d = deck::parse_text(
      "\r\n&model\r\n\tn_layer = 2\r\n\td_model = 64\r\n\tn_head = 8\r\n/\r\n", "s.nml");
  EXPECT_EQ(a.model.n_layer, 2);
  EXPECT_EQ(a.model.d_model, 64);
  EXPECT_EQ(a.model.n_head, 8);
  EXPECT_TRUE(deck::same_values(a, b));
  EXPECT_TRUE(deck::same_values(a, c));
  EXPECT_TRUE(deck::same_values(a, d));
}

// The cases below were found by reading decks with gfortran (test_deck_fortran checks them
// against gfortran itself); these check the values and messages without it.

TEST(DeckGrammar, StringContinuedOnTheNextLine) {
  // A quoted string may go on over line ends; gfortran drops the line end (and a CR) and
  // keeps the next line's blanks.
  Config c = deck::parse_text(
      "&run name = 'abc\ndef', out_dir = \"x\r\n  y\" /\n"
      "&parallel order = 'p', 'd\n' /\n&model init_from = 'it''\n''s' /\n",
      "s.nml");
  EXPECT_EQ(c.run.name, "abcdef");
  EXPECT_EQ(c.run.out_dir, "x  y");
  EXPECT_EQ(c.parallel.order, (std::vector<std::string>{"p", "d", "e", "d", "p"}));
  EXPECT_EQ(c.model.init_from, "it''s");
}

TEST(DeckGrammar, RealsWithoutExponentLetter) {
  // Fortran's 1.5-3 is 1.5e-3: a sign after the digits starts the exponent; q is
  // gfortran's exponent letter for quad precision.
  Config c = deck::parse_text(
      "&train lr = 1.5-3, min_lr = 1.5+3, eps = 15-3, clip = .5+1, weight_decay = 2q-1,"
      " beta1 = 1*5.-1 /",
      "r.nml");
  EXPECT_TRUE(bits_equal(c.train.lr, 1.5e-3));
  EXPECT_TRUE(bits_equal(c.train.min_lr, 1.5e3));
  EXPECT_TRUE(bits_equal(c.train.eps, 15e-3));
  EXPECT_TRUE(bits_equal(c.train.clip, 5.0));
  EXPECT_TRUE(bits_equal(c.train.weight_decay, 0.2));
  EXPECT_TRUE(bits_equal(c.train.beta1, 0.5));
}

TEST(DeckGrammar, DollarGroups) {
  // gfortran reads $name ... $end groups, and &end may be longer ("&endrun").
  Config c = deck::parse_text(
      "$run steps = 5 $end\n$MODEL n_layer = 2 /\n&train lr = 1e-3 $END\n&data val_samples = 3 "
      "&endgroup\n",
      "d.nml");
  EXPECT_EQ(c.run.steps, 5);
  EXPECT_EQ(c.model.n_layer, 2);
  EXPECT_TRUE(bits_equal(c.train.lr, 1e-3));
  EXPECT_EQ(c.data.val_samples, 3);
}

TEST(DeckGrammar, ArraySections) {
  using V = std::vector<std::string>;
  EXPECT_EQ(order_of("order(2:3) = 'd', 'd'"), (V{"t", "d", "d", "d", "p"}));
  EXPECT_EQ(order_of("order(2:3) = 'd'"), (V{"t", "d", "e", "d", "p"}));
  EXPECT_EQ(order_of("order(:) = 'p', 'p'"), (V{"p", "p", "e", "d", "p"}));
  EXPECT_EQ(order_of("order(4:) = 'c', 'c'"), (V{"t", "c", "e", "c", "c"}));
  EXPECT_EQ(order_of("order(:2) = 'p', 'p'"), (V{"p", "p", "e", "d", "p"}));
  EXPECT_EQ(order_of("order(1:5:2) = 'd', 'd', 't'"), (V{"d", "c", "d", "d", "t"}));
  EXPECT_EQ(order_of("order(5:1:-1) = 't', 't'"), (V{"t", "c", "e", "t", "t"}));
  EXPECT_EQ(order_of("order( +2 ) = 'p'"), (V{"t", "p", "e", "d", "p"}));
}

TEST(DeckGrammar, NullsCommentsAndSeparators) {
  // A null may follow the last element once (the comma before the next name);
  // a comment on a line of its own is no null; ';' separates like ','.
  Config a = deck::parse_text("&run steps = ,, seed = 5 /\n&parallel order = 't', 4*, /", "n.nml");
  EXPECT_EQ(a.run.steps, 100);
  EXPECT_EQ(a.run.seed, 5);
  EXPECT_EQ(a.parallel.order, deck::defaults().parallel.order);
  Config b =
      deck::parse_text("&run steps = ! c\n seed = 5 /\n&parallel order = 'p' ! c\n 'd' /", "n.nml");
  EXPECT_EQ(b.run.steps, 100);
  EXPECT_EQ(b.run.seed, 5);
  EXPECT_EQ(b.parallel.order, (std::vector<std::string>{"p", "d", "e", "d", "p"}));
  Config c = deck::parse_text("&run steps =\n ! c\n 5, log_every = 1*\n,\n seed = 2 /", "n.nml");
  EXPECT_EQ(c.run.steps, 5);
  EXPECT_EQ(c.run.log_every, 10);
  EXPECT_EQ(c.run.seed, 2);
  Config d = deck::parse_text("&run steps = 5; seed = 3 /\n&parallel order = 'p';; 'd' /", "n.nml");
  EXPECT_EQ(d.run.steps, 5);
  EXPECT_EQ(d.run.seed, 3);
  EXPECT_EQ(d.parallel.order, (std::vector<std::string>{"p", "c", "d", "d", "p"}));
}

TEST(DeckGrammar, MissingFile) {
  EXPECT_EQ(error_of([] { deck::parse_file("/nonexistent/x.nml"); }),
            "cannot open deck '/nonexistent/x.nml': No such file or directory");
}

// --- malformed decks: exact file:line:column and message ---------------------------

TEST(DeckErrors, MalformedDecks) {
  struct Case {
    const char* deck;
    const char* message;
  };
  const Case cases[] = {
      // unknown names, with and without a suggestion
      {"&modle\n n_layer = 2\n/\n",
       "deck.nml:1:1: unknown group '&modle' (did you mean '&model'?)"},
      {"&optimizer lr = 1 /", "deck.nml:1:1: unknown group '&optimizer'"},
      {"&parallel\n  tpp = 2\n/\n",
       "deck.nml:2:3: unknown key 'tpp' in &parallel (did you mean 'tp'?)"},
      {"&PARALLEL\n  TPP = 2 /",
       "deck.nml:2:3: unknown key 'TPP' in &parallel (did you mean 'tp'?)"},
      {"&run\n  colour = 3\n/", "deck.nml:2:3: unknown key 'colour' in &run"},
      // wrong types
      {"&parallel\n  tp = abc\n/", "deck.nml:2:8: expected an integer for parallel%tp, got 'abc'"},
      {"&model n_layer = 4.0 /", "deck.nml:1:18: expected an integer for model%n_layer, got '4.0'"},
      {"&model n_layer = '4' /",
       "deck.nml:1:18: expected an integer for model%n_layer, got the string '4'"},
      {"&run seed = 99999999999999999999 /",
       "deck.nml:1:13: expected an integer for run%seed, got '99999999999999999999' (beyond the "
       "64-bit range)"},
      {"&train\n lr = 1.0x-3\n/",
       "deck.nml:2:7: expected a real number for train%lr, got '1.0x-3'"},
      {"&train lr = 1e999 /",
       "deck.nml:1:13: expected a real number for train%lr, got '1e999' (beyond the range of a "
       "double)"},
      {"&train lr = -Infinity /",
       "deck.nml:1:13: expected a real number for train%lr, got '-Infinity' (infinities and NaNs "
       "are not allowed)"},
      {"&train lr = 1.5e /", "deck.nml:1:13: expected a real number for train%lr, got '1.5e'"},
      {"&train lr = 1.5-3.0 /",
       "deck.nml:1:13: expected a real number for train%lr, got '1.5-3.0'"},
      {"&run steps = 15-3 /", "deck.nml:1:14: expected an integer for run%steps, got '15-3'"},
      {"&run trace = .x /",
       "deck.nml:1:14: expected a logical (.true. or .false.) for run%trace, got '.x'"},
      {"&run trace = yes /",
       "deck.nml:1:14: expected a logical (.true. or .false.) for run%trace, got 'yes'"},
      {"&run trace = 1 /",
       "deck.nml:1:14: expected a logical (.true. or .false.) for run%trace, got '1'"},
      {"&model dtype = fp64 /",
       "deck.nml:1:16: expected a quoted string for model%dtype, got fp64 (write it as 'fp64')"},
      {"&run\r\n  steps = x\r\n/\r\n", "deck.nml:2:11: expected an integer for run%steps, got 'x'"},
      // ranges and choices
      {"&parallel zero = 4 /",
       "deck.nml:1:18: parallel%zero = 4 is out of range: must be in [0, 3]"},
      {"&run\n steps = -5\n/", "deck.nml:2:10: run%steps = -5 is out of range: must be >= 0"},
      {"&parallel bucket_mb = 0.0 /",
       "deck.nml:1:23: parallel%bucket_mb = 0.0 is out of range: must be >= 0.001"},
      {"&model dtype = 'fp16' /",
       "deck.nml:1:16: model%dtype = 'fp16' is not one of 'fp32', 'fp64', 'bf16'"},
      {"&train optimizer = 'adam' /",
       "deck.nml:1:20: train%optimizer = 'adam' is not one of 'adamw', 'sgd'"},
      {"&parallel order(3) = 'x' /",
       "deck.nml:1:22: parallel%order(3) = 'x' is not one of 't', 'c', 'e', 'd', 'p'"},
      // duplicates
      {"&model\n n_layer = 2\n d_model = 64\n N_LAYER = 3\n/",
       "deck.nml:4:2: duplicate key model%n_layer (first set at line 2)"},
      {"&parallel\n order = 't', 'c', 'e', 'd', 'p'\n order(2) = 'c'\n/",
       "deck.nml:3:2: duplicate key parallel%order(2) (first set at line 2)"},
      {"&run\n\tname = 'x'\n\tname = 'y'\n/",
       "deck.nml:3:2: duplicate key run%name (first set at line 2)"},
      {"&run /\n&model /\n&run steps = 1 /",
       "deck.nml:3:1: duplicate group &run (first at line 1)"},
      // strings and groups that do not end
      {"&run\n name = 'abc\n/", "deck.nml:2:9: unterminated string (no closing quote)"},
      {"&run name = \"abc", "deck.nml:1:13: unterminated string (no closing quote)"},
      {"&run name = 'a'x /",
       "deck.nml:1:16: expected ',' or a blank after the string 'a', got 'x'"},
      {"&run\n steps = 5\n",
       "deck.nml:1:1: unterminated group &run (the file ends before its closing '/')"},
      {"\n\n  &model n_layer = 2",
       "deck.nml:3:3: unterminated group &model (the file ends before its closing '/')"},
      {"&run steps = 5\n&model n_layer = 2 /",
       "deck.nml:2:1: &run is not closed before '&model' (missing '/')"},
      {"! nothing\n&end\n", "deck.nml:2:1: '&end' outside a group"},
      {"& run /", "deck.nml:1:1: expected a group name after '&'"},
      // array indices and value counts
      {"&parallel order(6) = 'p' /",
       "deck.nml:1:17: bad array index (6) for parallel%order: expected i, lo:hi or lo:hi:step "
       "within 1..5"},
      {"&parallel order(0) = 'p' /",
       "deck.nml:1:17: bad array index (0) for parallel%order: expected i, lo:hi or lo:hi:step "
       "within 1..5"},
      {"&parallel order(3:2) = 'p' /",
       "deck.nml:1:17: bad array index (3:2) for parallel%order: expected i, lo:hi or lo:hi:step "
       "within 1..5"},
      {"&parallel order(::2) = 'p' /",
       "deck.nml:1:17: bad array index (::2) for parallel%order: expected i, lo:hi or lo:hi:step "
       "within 1..5"},
      {"&parallel order(2 3) = 'p' /",
       "deck.nml:1:17: bad array index (2 3) for parallel%order: a blank separates two numbers "
       "(gfortran would "
       "read a section; write lo:hi)"},
      {"&parallel order(1:2) = 'p', 'p', 'p' /",
       "deck.nml:1:34: too many values for parallel%order(1:2) (the section has 2 elements)"},
      // what gfortran rejects: a blank before the index, nulls beyond the size, a comment
      // where the value should be, a comment glued to a name
      {"&parallel order (1) = 'c' /",
       "deck.nml:1:17: expected '=' after 'order' (an array index follows the name without a "
       "blank)"},
      {"&run steps = 2* /", "deck.nml:1:14: too many values for run%steps (it is a scalar)"},
      {"&parallel order = 't', 5* /",
       "deck.nml:1:24: too many values for parallel%order (it has 5 elements)"},
      {"&run steps = ,,, /", "deck.nml:1:16: too many values for run%steps (it is a scalar)"},
      {"&parallel order = 'p',,,,,,, /",
       "deck.nml:1:28: too many values for parallel%order (it has 5 elements)"},
      // (reported at the comment, on the line of the '=', not at the value it hides)
      {"&run steps = ! the steps\n 5 /",
       "deck.nml:1:14: a comment right after '=' or ',' ends the values of run%steps (gfortran "
       "reads no value after it, not even the one at 2:2): move the comment after the value"},
      {"&run steps = ! the steps\n 5\n/",
       "deck.nml:1:14: a comment right after '=' or ',' ends the values of run%steps (gfortran "
       "reads no value after it, not even the one at 2:2): move the comment after the value"},
      {"&parallel order = 'p', ! c\n 'd' /",
       "deck.nml:1:24: a comment right after '=' or ',' ends the values of parallel%order "
       "(gfortran reads no value after it, not even the one at 2:2): move the comment after the "
       "value"},
      {"&run steps = 5 6\n/", "deck.nml:1:16: too many values for run%steps (it is a scalar)"},
      {"&run steps! c\n = 5 /", "deck.nml:1:13: expected '=' after 'steps'"},
      {"&parallel tp(1) = 2 /", "deck.nml:1:13: parallel%tp is a scalar and takes no array index"},
      {"&parallel order = 't','c','e','d','p','t' /",
       "deck.nml:1:39: too many values for parallel%order (it has 5 elements)"},
      {"&parallel order(4) = 'd', 'p', 't' /",
       "deck.nml:1:32: too many values for parallel%order (it has 5 elements)"},
      {"&parallel order = 6*'t' /",
       "deck.nml:1:19: too many values for parallel%order (it has 5 elements)"},
      {"&parallel tp = 2, 4 /", "deck.nml:1:19: too many values for parallel%tp (it is a scalar)"},
      {"&run name = 'a' 'b' /", "deck.nml:1:17: too many values for run%name (it is a scalar)"},
      {"&parallel order = 0*'t' /", "deck.nml:1:19: bad repeat count in '0*'"},
      {"&run trace = 1 /",
       "deck.nml:1:14: expected a logical (.true. or .false.) for run%trace, got '1'"},
      // item syntax
      {"&model\n n_layer 4\n/", "deck.nml:2:10: expected '=' after 'n_layer'"},
      {"&model n_layer = 4) /", "deck.nml:1:19: expected ',' or a blank after '4', got ')'"},
      {"&run 'x' = 1 /", "deck.nml:1:6: expected a key name in &run, got a string"},
      {"&run = 3 /", "deck.nml:1:6: expected a key name in &run, got '='"},
  };
  for (const Case& c : cases) EXPECT_EQ(parse_error(c.deck), c.message) << "deck:\n" << c.deck;
  EXPECT_GE(sizeof cases / sizeof cases[0], 25u);
}

// --- --set overrides -------------------------------------------------------------

TEST(DeckOverrides, ApplyAfterTheFile) {
  Config c = deck::parse_text(
      "&model n_layer = 2 /\n&parallel order = 't','c','e','d','p' /", "o.nml",
      {"model%n_layer=8", "data%path=/x/y.txt", "parallel%order=d,t,c,e,p", "Train%LR=1.0d-3",
       "run%trace=T", "run%name='it''s'", "model%dtype = fp64"});
  EXPECT_EQ(c.model.n_layer, 8);
  EXPECT_EQ(c.data.path, "/x/y.txt");
  EXPECT_EQ(c.parallel.order, (std::vector<std::string>{"d", "t", "c", "e", "p"}));
  EXPECT_TRUE(bits_equal(c.train.lr, 1.0e-3));
  EXPECT_TRUE(c.run.trace);
  EXPECT_EQ(c.run.name, "it's");
  EXPECT_EQ(c.model.dtype, "fp64");
  Config q = deck::parse_text("", "o.nml", {"parallel%order='p', 'd', 'e', 'c', 't'"});
  EXPECT_EQ(q.parallel.order, (std::vector<std::string>{"p", "d", "e", "c", "t"}));
  EXPECT_EQ(error_of([] {
              deck::parse_text("", "o.nml", {"parallel%order(1)=c", "parallel%order='p'"});
            }),
            "--set parallel%order='p': duplicate key parallel%order(1) (already set by an earlier "
            "--set)");
  Config e = deck::parse_text("", "o.nml", {"parallel%order(2)=d", "run%name=a, b"});
  EXPECT_EQ(e.parallel.order, (std::vector<std::string>{"t", "d", "e", "d", "p"}));
  EXPECT_EQ(e.run.name, "a, b");
}

TEST(DeckOverrides, Errors) {
  EXPECT_EQ(set_error({"parallel%tpp=2"}),
            "--set parallel%tpp=2: unknown key 'tpp' in &parallel (did you mean 'tp'?)");
  EXPECT_EQ(set_error({"modle%n_layer=2"}),
            "--set modle%n_layer=2: unknown group '&modle' (did you mean '&model'?)");
  EXPECT_EQ(set_error({"n_layer=2"}), "--set n_layer=2: expected group%key=value");
  EXPECT_EQ(set_error({"model%n_layer"}), "--set model%n_layer: expected group%key=value");
  EXPECT_EQ(set_error({"model%n_layer=abc"}),
            "--set model%n_layer=abc: expected an integer for model%n_layer, got 'abc'");
  EXPECT_EQ(set_error({"model%n_layer="}), "--set model%n_layer=: no value given");
  EXPECT_EQ(set_error({"model%n_layer=2 3"}),
            "--set model%n_layer=2 3: too many values for model%n_layer (it is a scalar)");
  EXPECT_EQ(set_error({"model%n_layer=4 d_model=3"}),
            "--set model%n_layer=4 d_model=3: unexpected 'd_model=3' in the value");
  EXPECT_EQ(set_error({"model%dtype=fp16"}),
            "--set model%dtype=fp16: model%dtype = 'fp16' is not one of 'fp32', 'fp64', 'bf16'");
  EXPECT_EQ(set_error({"parallel%order(7)=t"}),
            "--set parallel%order(7)=t: bad array index (7) for parallel%order: expected i, lo:hi "
            "or lo:hi:step "
            "within 1..5");
  EXPECT_EQ(
      set_error({"parallel%order=t,c,e,d,p,t"}),
      "--set parallel%order=t,c,e,d,p,t: too many values for parallel%order (it has 5 elements)");
  EXPECT_EQ(set_error({"parallel%zero=9"}),
            "--set parallel%zero=9: parallel%zero = 9 is out of range: must be in [0, 3]");
  EXPECT_EQ(set_error({"model%n_layer=2", "model%n_layer=3"}),
            "--set model%n_layer=3: duplicate key model%n_layer (already set by an earlier --set)");
  EXPECT_EQ(set_error({"run%name='abc"}),
            "--set run%name='abc: unterminated string (no closing quote)");
  EXPECT_EQ(set_error({"run%steps=5/"}), "--set run%steps=5/: unexpected '/' in the value");
}

// --- cross-field validation -------------------------------------------------------

TEST(DeckValidate, ResolvesDataParallelAndAcceptsGoodDecks) {
  Config c = deck::defaults();
  c.deck_path = "deck.nml";
  c.parallel.tp = 2;
  c.train.micro_batch = 2;
  deck::validate(c, 8);
  EXPECT_EQ(c.parallel.dp, 4);
  Config d = deck::defaults();
  deck::validate(d, 1);
  EXPECT_EQ(d.parallel.dp, 1);
  // A full 5-axis grid on 32 ranks: D2 T2 P2 C2 E2.
  Config g = deck::parse_text(
      "&model n_expert = 4, n_layer = 8, seq_len = 64 /\n"
      "&parallel dp = 2, tp = 2, pp = 2, cp = 2, ep = 2, virtual_stages = 2, pp_schedule = "
      "'interleaved',"
      " sequence_parallel = .true., order = 'p','d','e','c','t' /\n"
      "&train global_batch = 32, micro_batch = 4 /",
      "deck.nml");
  deck::validate(g, 32);
  EXPECT_EQ(g.parallel.dp, 2);
}

TEST(DeckValidate, ContextParallelLayoutSetsTheSequenceMultiple) {
  // zigzag (the default) cuts a sequence into 2*cp chunks, contiguous into cp; cp = 1
  // cuts nothing, whatever the layout.
  auto error = [](int cp, const std::string& layout, std::int64_t seq_len) {
    Config c = deck::defaults();
    c.parallel.cp = cp, c.parallel.cp_layout = layout, c.model.seq_len = seq_len;
    return error_of([&] { deck::validate(c, cp); });
  };
  EXPECT_EQ(deck::defaults().parallel.cp_layout, "zigzag");
  EXPECT_EQ(error(2, "zigzag", 64), "no error");
  EXPECT_EQ(error(4, "zigzag", 24), "no error");
  EXPECT_EQ(error(2, "contiguous", 66), "no error");
  EXPECT_EQ(error(4, "contiguous", 36), "no error");
  EXPECT_EQ(error(1, "zigzag", 33), "no error");
  EXPECT_EQ(error(1, "contiguous", 33), "no error");
  EXPECT_NE(error(2, "zigzag", 66), "no error");
  EXPECT_NE(error(4, "zigzag", 36), "no error");
  EXPECT_NE(error(4, "contiguous", 30), "no error");
  // From a deck file, with the key's default and its spelling in the message.
  Config d = deck::parse_text("&model seq_len = 30 /\n&parallel cp = 2, cp_layout = 'contiguous' /",
                              "deck.nml");
  EXPECT_EQ(error_of([&] { deck::validate(d, 2); }), "no error");
  d.parallel.cp_layout = "zigzag";
  EXPECT_EQ(error_of([&] { deck::validate(d, 2); }),
            "deck.nml: parallel%cp = 2 with parallel%cp_layout = 'zigzag' needs model%seq_len = 30 "
            "to be a multiple "
            "of 2*cp = 4 (rank c holds chunks c and 2cp-1-c of 2cp)");
}

TEST(DeckValidate, CrossFieldErrors) {
  struct Case {
    int world;
    std::function<void(Config&)> change;
    std::string message;
  };
  const std::vector<Case> cases = {
      {4, [](Config& c) { c.parallel.tp = 3; },
       "parallel%dp = -1 needs the world size 4 to be a multiple of tp*pp*cp*ep = 3*1*1*1 = 3"},
      {4, [](Config& c) { c.parallel.dp = 2; },
       "parallel%dp*tp*pp*cp*ep = 2*1*1*1*1 = 2 does not match the world size 4"},
      {1, [](Config& c) { c.model.d_model = 130; },
       "model%n_head = 4 does not divide model%d_model = 130"},
      {3, [](Config& c) { c.parallel.tp = 3; }, "parallel%tp = 3 does not divide model%n_head = 4"},
      {4, [](Config& c) { c.model.n_layer = 6, c.parallel.pp = 4; },
       "parallel%pp*virtual_stages = 4*1 = 4 does not divide model%n_layer = 6 (set "
       "parallel%pp_layers for an "
       "uneven split over the stages)"},
      {2,
       [](Config& c) {
         c.parallel.pp = 2, c.parallel.pp_layers[0] = 3, c.parallel.pp_layers[1] = 2;
       },
       "parallel%pp_layers adds up to 5 layers, model%n_layer = 4"},
      {2, [](Config& c) { c.parallel.pp = 2, c.parallel.pp_layers[0] = 4; },
       "parallel%pp_layers must give one positive layer count per pipeline chunk "
       "(parallel%pp*virtual_stages = 2, "
       "in order: chunk c of stage s is number c*pp + s + 1), got 1 before the first 0"},
      {2,
       [](Config& c) {
         c.parallel.pp = 2, c.parallel.pp_layers[0] = 3, c.parallel.pp_layers[2] = 1;
       },
       "parallel%pp_layers must give one positive layer count per pipeline chunk "
       "(parallel%pp*virtual_stages = 2, "
       "in order: chunk c of stage s is number c*pp + s + 1), got 1 before the first 0"},
      {8,
       [](Config& c) {
         c.model.n_layer = 8, c.parallel.pp = 4, c.parallel.dp = 2, c.parallel.virtual_stages = 2;
         c.parallel.pp_schedule = "interleaved", c.train.global_batch = 6, c.train.micro_batch = 1;
       },
       "parallel%pp_schedule = 'interleaved' runs micro-batches in groups of parallel%pp = 4: "
       "train%global_batch/(micro_batch*dp*ep) = 6/2 = 3 micro-batches per step is not a multiple "
       "of it"},
      {2, [](Config& c) { c.parallel.pp = 2, c.parallel.virtual_stages = 2; },
       "parallel%virtual_stages = 2 needs parallel%pp_schedule = 'interleaved' or 'zb-v' (got "
       "'1f1b')"},
      {2, [](Config& c) { c.parallel.pp = 2, c.parallel.pp_schedule = "zb-v"; },
       "parallel%pp_schedule = 'zb-v' places two chunks per pipeline rank in a V: it needs "
       "parallel%virtual_stages = 2 (got 1)"},
      {2,
       [](Config& c) {
         c.parallel.pp = 2, c.parallel.pp_schedule = "zb-h1", c.model.n_expert = 4;
         c.model.top_k = 2;
       },
       "parallel%pp_schedule = 'zb-h1' splits each block's backward into input and weight "
       "gradients, which MoE blocks (model%n_expert = 4) do not do yet; use '1f1b' or "
       "'interleaved'"},
      {1, [](Config& c) { c.parallel.virtual_stages = 2, c.parallel.pp_schedule = "interleaved"; },
       "parallel%virtual_stages = 2 needs parallel%pp > 1"},
      {2, [](Config& c) { c.parallel.pp = 2, c.parallel.pp_schedule = "interleaved"; },
       "parallel%pp_schedule = 'interleaved' needs parallel%virtual_stages > 1"},
      {2, [](Config& c) { c.train.global_batch = 12, c.train.micro_batch = 4; },
       "train%micro_batch*parallel%dp*parallel%ep = 4*2*1 = 8 does not divide train%global_batch = "
       "12"},
      {2, [](Config& c) { c.parallel.cp = 2, c.model.seq_len = 66; },
       "parallel%cp = 2 with parallel%cp_layout = 'zigzag' needs model%seq_len = 66 to be a "
       "multiple of 2*cp = 4 "
       "(rank c holds chunks c and 2cp-1-c of 2cp)"},
      {4, [](Config& c) { c.parallel.cp = 4, c.model.seq_len = 30; },
       "parallel%cp = 4 with parallel%cp_layout = 'zigzag' needs model%seq_len = 30 to be a "
       "multiple of 2*cp = 8 "
       "(rank c holds chunks c and 2cp-1-c of 2cp)"},
      {4,
       [](Config& c) {
         c.parallel.cp = 4, c.parallel.cp_layout = "contiguous", c.model.seq_len = 30;
       },
       "parallel%cp = 4 with parallel%cp_layout = 'contiguous' needs model%seq_len = 30 to be a "
       "multiple of cp = 4 "
       "(rank c holds chunk c of cp)"},
      {2, [](Config& c) { c.parallel.cp = 2, c.parallel.cp_layout = "ring"; },
       "parallel%cp_layout = 'ring' is not one of 'zigzag', 'contiguous'"},
      {4, [](Config& c) { c.model.n_expert = 6, c.parallel.ep = 4, c.train.micro_batch = 4; },
       "parallel%ep = 4 does not divide model%n_expert = 6"},
      {2, [](Config& c) { c.parallel.ep = 2, c.train.micro_batch = 8; },
       "parallel%ep = 2 needs model%n_expert > 0 (the model has no experts)"},
      {1, [](Config& c) { c.model.n_expert = 2, c.model.top_k = 3; },
       "model%top_k = 3 exceeds model%n_expert = 2"},
      {4,
       [](Config& c) {
         c.parallel.tp = 4, c.parallel.sequence_parallel = true, c.train.micro_batch = 1,
         c.train.global_batch = 1, c.model.seq_len = 6;
       },
       "parallel%sequence_parallel needs parallel%tp = 4 to divide "
       "train%micro_batch*model%seq_len/parallel%cp = 1*6/1 = 6"},
      {1,
       [](Config& c) {
         c.parallel.order = {"t", "t", "e", "d", "p"};
       },
       "parallel%order = 't', 't', 'e', 'd', 'p' is not a permutation of t, c, e, d, p"},
      {1, [](Config& c) { c.data.source = "bytes", c.data.path = "x.txt", c.model.vocab = 100; },
       "data%source = 'bytes' needs model%vocab >= 256 (got 100)"},
      {1, [](Config& c) { c.data.source = "u16"; },
       "data%source = 'u16' needs a file in data%path (or a blend in data%paths)"},
      {1, [](Config& c) { c.data.source = "bytes"; },
       "data%source = 'bytes' needs a file in data%path (or a blend in data%paths)"},
      {1,
       [](Config& c) {
         c.data.source = "indexed", c.data.path = "a";
         c.data.paths[0] = "b", c.data.weights[0] = 1;
       },
       "data%path = 'a' and data%paths both name data: give one file in data%path, or a blend "
       "in data%paths"},
      {1, [](Config& c) { c.data.source = "indexed", c.data.paths[1] = "b"; },
       "data%paths(2) = 'b' needs a weight > 0 in data%weights(2)"},
      {1, [](Config& c) { c.data.source = "indexed", c.data.weights[2] = 0.5; },
       "data%weights(3) = 0.5 has no file in data%paths(3)"},
      {1, [](Config& c) { c.data.paths[0] = "b", c.data.weights[0] = 1; },
       "data%paths is a blend of files: it needs data%source = 'bytes', 'u16' or 'indexed' (the "
       "synthetic source reads no file)"},
      {1, [](Config& c) { c.parallel.grad_dtype = "bf16"; },
       "parallel%grad_dtype = 'bf16' needs model%dtype = 'bf16' (got 'fp32'); leave it 'auto' for "
       "an fp32 model"},
      {1, [](Config& c) { c.parallel.wire_dtype = "bf16"; },
       "parallel%wire_dtype = 'bf16' needs model%dtype = 'bf16' (got 'fp32')"},
      {1,
       [](Config& c) {
         c.model.dtype = "bf16", c.parallel.wire_dtype = "bf16", c.parallel.zero = 1;
       },
       "parallel%wire_dtype = 'bf16' needs parallel%zero >= 2 (got 1): the bf16 wire is ZeRO 2/3's "
       "reduce-scatter, summed in fp32 where it arrives; ZeRO 0/1 all-reduce in the gradient type"},
      {1, [](Config& c) { c.model.n_expert = 2, c.model.moe_every = 5; },
       "model%moe_every = 5 exceeds model%n_layer = 4: no block would have experts"},
      {1, [](Config& c) { c.model.n_expert = 9223372036854775804; },
       "model%n_expert*(the MLP's parameters) overflows a 64-bit integer"},
      {1, [](Config& c) { c.run.debug_fail_rank = 1; },
       "run%debug_fail_rank = 1 is not a rank of this run (1 rank)"},
      {1, [](Config& c) { c.run.out_dir = "out "; },
       "run%out_dir = 'out ' begins or ends with blanks: name the folder without them"},
      {1, [](Config& c) { c.checkpoint.dir = "  "; },
       "checkpoint%dir = '  ' is blank: name a folder"},
      {1, [](Config& c) { c.checkpoint.keep = 2147483648; },
       "checkpoint%keep = 2147483648 is out of range: must be in [1, 2147483647]"},
      {2, [](Config& c) { c.run.debug_flip_rank = 2, c.train.micro_batch = 8; },
       "run%debug_flip_rank = 2 is not a rank of this run (2 ranks)"},
      {1, [](Config& c) { c.run.straggler_factor = 0.9; },
       "run%straggler_factor = 0.9 would warn of every rank: the slowest is never faster than the "
       "median; use a factor of at least 1 (e.g. 2), or 0 for no warnings"},
      {1, [](Config& c) { c.train.spike_factor = 0.5; },
       "train%spike_factor = 0.5 would flag ordinary steps: use a factor above 1 (e.g. 3), or 0 "
       "for off"},
      {1, [](Config& c) { c.parallel.zero_scope = "node"; },
       "parallel%zero_scope = 'node' places ZeRO shards: it needs parallel%zero >= 1 (got 0)"},
      {2,
       [](Config& c) {
         c.parallel.zero_scope = "node", c.parallel.zero = 1, c.parallel.ep = 2;
         c.model.n_expert = 2, c.train.micro_batch = 8;
       },
       "parallel%zero_scope = 'node' is not implemented with experts split over ep "
       "(parallel%ep = 2); use 'global'"},
      {1, [](Config& c) { c.model.dtype = "fp64", c.parallel.grad_dtype = "fp32"; },
       "parallel%grad_dtype = 'fp32' needs model%dtype = 'bf16' (got 'fp64'); leave it 'auto' for "
       "an fp64 model"},
      {1, [](Config& c) { c.parallel.tp = 0; }, "parallel%tp = 0 is out of range: must be >= 1"},
      {1, [](Config& c) { c.model.dtype = "fp8"; },
       "model%dtype = 'fp8' is not one of 'fp32', 'fp64', 'bf16'"},
  };
  for (const Case& k : cases) {
    Config c = deck::defaults();
    c.deck_path = "deck.nml";
    k.change(c);
    EXPECT_EQ(error_of([&] { deck::validate(c, k.world); }), "deck.nml: " + k.message);
  }
  // A CUDA deck is valid whatever this build has (--plan plans it on a login node); the
  // trainer refuses to run it on a build without CUDA (parallel::check_supported).
  Config cuda = deck::defaults();
  cuda.deck_path = "deck.nml";
  cuda.backend.device = "cuda";
  EXPECT_EQ(error_of([&] { deck::validate(cuda, 1); }), "no error");
}

TEST(DeckValidate, RangeHoles) {
  // Values each key's range allows but the run cannot use: found before step 1, with the rule.
  struct Case {
    std::function<void(Config&)> change;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](Config& c) { c.run.out_dir = ""; },
       "run%out_dir = '' is empty: name a folder for the output (e.g. 'out')"},
      {[](Config& c) { c.model.vocab = 2147483648; },
       "model%vocab = 2147483648 exceeds 2147483647 (the kernels index the vocabulary with 32-bit "
       "ints)"},
      {[](Config& c) { c.model.vocab = 3000000, c.model.d_model = 1024; },
       "model%vocab*d_model = 3000000*1024 = 3072000000 elements of the token embedding exceed "
       "2147483647 (the "
       "kernels and MPI index one tensor with 32-bit ints)"},
      {[](Config& c) { c.model.d_model = 32768; },
       "max(3, model%ffn_mult)*d_model*d_model = 4*32768*32768 = 4294967296 elements of one weight "
       "matrix exceed "
       "2147483647 (the kernels and MPI index one tensor with 32-bit ints)"},
      {[](Config& c) { c.model.seq_len = 4194304; },
       "train%micro_batch*model%seq_len*max(3, model%ffn_mult)*d_model = 16*4194304*4*128 = "
       "34359738368 activation "
       "elements of one micro-batch exceed 2147483647 (the kernels index them with 32-bit ints)"},
      {[](Config& c) { c.model.seq_len = 9223372036854775807; },
       "train%micro_batch*model%seq_len overflows a 64-bit integer"},
      {[](Config& c) { c.train.global_batch = 4294967296, c.train.micro_batch = 1; },
       "train%global_batch*model%seq_len = 4294967296*64 = 274877906944 tokens per step exceed "
       "2147483647"},
      {[](Config& c) { c.data.val_samples = 9223372036854775807; },
       "data%val_samples*model%seq_len overflows a 64-bit integer"},
      {[](Config& c) { c.data.val_samples = 1 << 30; },
       "data%val_samples*model%seq_len = 1073741824*64 = 68719476736 tokens per validation pass "
       "exceed 2147483647"},
      {[](Config& c) { c.train.beta1 = 1.0; },
       "train%beta1 = 1.0 is out of range: must be in [0.0, 1.0)"},
      {[](Config& c) { c.train.beta2 = 1.0; },
       "train%beta2 = 1.0 is out of range: must be in [0.0, 1.0)"},
      {[](Config& c) { c.train.beta2 = -0.5; },
       "train%beta2 = -0.5 is out of range: must be in [0.0, 1.0)"},
  };
  for (const Case& k : cases) {
    Config c = deck::defaults();
    c.deck_path = "deck.nml";
    k.change(c);
    EXPECT_EQ(error_of([&] { deck::validate(c, 1); }), "deck.nml: " + k.message);
  }
  // In the deck the bounds are found where the value is.
  EXPECT_EQ(parse_error("&train\n beta1 = 1.0\n/"),
            "deck.nml:2:10: train%beta1 = 1.0 is out of range: must be in [0.0, 1.0)");
  Config edge = deck::parse_text("&train beta1 = 0.0, beta2 = 0.9999999 /", "deck.nml");
  EXPECT_NO_THROW(deck::validate(edge, 1));
  EXPECT_NE(deck::help_deck().find("| `beta1` | real | `0.9` | 0.0 to below 1.0 |"),
            std::string::npos);
}

TEST(DeckValidate, StringsAndControlCharacters) {
  // No raw control byte from a deck reaches a message; strings may hold none (tabs aside),
  // and no NUL; and at most 4096 characters.
  auto raw_free = [](const std::string& m) {
    for (char c : m)
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) return false;
    return true;
  };
  std::string nul = parse_error(std::string("&run name = 'a\0b' /", 19));
  EXPECT_EQ(nul,
            "deck.nml:1:13: run%name = 'a\\x00b' contains the control character \\x00 (not allowed "
            "in a string)");
  std::string esc = parse_error("&run name = '\x1b[31mred' /");
  EXPECT_EQ(esc,
            "deck.nml:1:13: run%name = '\\x1b[31mred' contains the control character \\x1b (not "
            "allowed in a "
            "string)");
  EXPECT_EQ(parse_error("&run st\x01"
                        "eps = 5 /"),
            "deck.nml:1:6: unknown key 'st\\x01eps' in &run (did you mean 'steps'?)");
  EXPECT_EQ(parse_error("&ru\x07n steps = 5 /"),
            "deck.nml:1:1: unknown group '&ru\\x07n' (did you mean '&run'?)");
  EXPECT_EQ(parse_error("&run steps = 5\x1b /"),
            "deck.nml:1:14: expected an integer for run%steps, got '5\\x1b'");
  EXPECT_EQ(set_error({"run%name=a\nb"}),
            "--set run%name=a\\x0ab: run%name = 'a\\x0ab' contains the control character \\x0a "
            "(not allowed in a "
            "string)");
  for (const std::string& m : {nul, esc, set_error({"run%name=a\rb"}), parse_error("&run\x1b\n/")})
    EXPECT_TRUE(raw_free(m)) << m;
  Config tab = deck::parse_text("&run name = 'a\tb' /", "deck.nml");
  EXPECT_EQ(tab.run.name, "a\tb");
  std::string long_name(5000, 'x');
  EXPECT_EQ(parse_error("&run name = '" + long_name + "' /"),
            "deck.nml:1:13: run%name is 5000 characters long (at most 4096 are allowed)");
  EXPECT_NO_THROW(deck::parse_text("&run name = '" + std::string(4096, 'x') + "' /", "deck.nml"));
  // A group's name inside a string is where gfortran would start reading that group.
  EXPECT_EQ(parse_error("&model init_from = 'a &run b' /"),
            "deck.nml:1:20: model%init_from = 'a &run b' contains '&run', which gfortran would "
            "take for the start of "
            "a group");
  EXPECT_NO_THROW(
      deck::parse_text("&model init_from = 'R&D/&running/$HOME/$data.bin/&run' /", "deck.nml"));
  EXPECT_EQ(parse_error("&run name = 'a!b' / &model n_layer = 2 /"),
            "deck.nml:1:21: gfortran would not find this &model: a '!' in a string before it hides "
            "the rest of the "
            "line; start the group on a new line");
  EXPECT_EQ(parse_error("&run name = 'a &model\nx' /\n&model n_layer = 2 /"),
            "deck.nml:1:16: gfortran would start reading &model here (it takes '&model' inside a "
            "string or value for "
            "the group)");
}

TEST(DeckValidate, VocabularyIsNotCheckedAgainstTensorParallel) {
  Config c = deck::defaults();
  c.model.vocab = 257;  // padded later, not rejected
  c.parallel.tp = 2;
  EXPECT_NO_THROW(deck::validate(c, 2));
}

// --- echo and reference --------------------------------------------------------------

namespace {

// Every key moved off its default, within its range and choices.
Config every_key_changed() {
  Config c = deck::defaults();
  for (const deck::KeySpec& s : deck::key_specs()) {
    for (int i = 0; i < s.size(); ++i) {
      deck::Value d = s.get(c, i);
      switch (s.type) {
        case deck::KeyType::Int: {
          std::int64_t x = std::get<std::int64_t>(d);
          s.set(c, i,
                deck::Value(std::int64_t(s.hi.limited && x + 1 > s.hi.as_int ? x - 1 : x + 1)));
          break;
        }
        case deck::KeyType::Real: {
          double x = std::get<double>(d);
          for (double v : {std::nextafter(0.1, 1.0), 1.0 / 3.0, 0.7, 2.5e-7, 12345.678901234567}) {
            bool in = (!s.lo.limited || v >= s.lo.as_real) && (!s.hi.limited || v <= s.hi.as_real);
            if (in && v != x) {
              s.set(c, i, deck::Value(v));
              break;
            }
          }
          break;
        }
        case deck::KeyType::Bool:
          s.set(c, i, deck::Value(!std::get<bool>(d)));
          break;
        case deck::KeyType::Str: {
          std::string x = std::get<std::string>(d), v = "it's \"quoted\" / ! & % " + s.key;
          if (!s.choices.empty()) {
            v = s.choices[s.choices.size() - 1 - static_cast<std::size_t>(i) % s.choices.size()];
            if (s.extent == 0 && v == x) v = s.choices[0];
          }
          s.set(c, i, deck::Value(v));
          break;
        }
      }
    }
  }
  return c;
}

}  // namespace

TEST(DeckEcho, DefaultsRoundTripAndAreMarked) {
  Config d = deck::defaults();
  std::string text = deck::echo(d);
  Config back = deck::parse_text(text, "echo.nml");
  EXPECT_TRUE(deck::same_values(d, back));
  std::istringstream lines(text);
  std::string line;
  std::size_t keys = 0, marked = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("    ", 0) != 0) continue;
    ++keys;
    if (line.size() >= 9 && line.compare(line.size() - 9, 9, "! default") == 0) ++marked;
  }
  EXPECT_EQ(keys, deck::key_specs().size());
  EXPECT_EQ(marked, keys);
}

TEST(DeckEcho, EveryKeyChangedRoundTrips) {
  Config c = every_key_changed();
  c.deck_path = "echo.nml";
  Config d = deck::defaults();
  for (const deck::KeySpec& s : deck::key_specs())
    EXPECT_NE(deck::value_text(c, s), deck::value_text(d, s)) << s.name();
  std::string text = deck::echo(c);
  EXPECT_EQ(text.find("! default"), text.find("! default\"")) << "only the header mentions it:\n"
                                                              << text;
  Config back = deck::parse_text(text, "echo.nml");
  EXPECT_TRUE(deck::same_values(c, back)) << text;
  EXPECT_EQ(deck::echo(back), text);
}

TEST(DeckEcho, MarksOnlyDefaultKeysAndShowsResolvedValues) {
  Config c = deck::parse_text("&model n_layer = 8 /", "m.nml");
  deck::validate(c, 1);
  std::string text = deck::echo(c);
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    bool is_default = line.find("! default") != std::string::npos;
    if (line.find(" n_layer ") != std::string::npos) {
      EXPECT_NE(line.find("= 8"), std::string::npos);
      EXPECT_FALSE(is_default) << line;
    }
    if (line.find(" dp ") != std::string::npos) {
      EXPECT_NE(line.find("= 1"), std::string::npos);  // resolved from -1
      EXPECT_FALSE(is_default) << line;
    }
    if (line.find(" d_model ") != std::string::npos) {
      EXPECT_TRUE(is_default) << line;
    }
  }
}

TEST(DeckEcho, RealsRoundTripBitForBit) {
  for (double x : {std::nextafter(0.1, 1.0), 1.0 / 3.0, 5e-324, 2.2250738585072014e-308,
                   1.7976931348623157e308, 1e22, 123456789012345680000.0, 3e-4, 0.0, 100.0, 1e-7,
                   9007199254740993.0, 4503599627370497.5, 1e15 + 0.25}) {
    Config c = deck::defaults();
    c.train.lr = x;
    Config back = deck::parse_text(deck::echo(c), "r.nml");
    EXPECT_TRUE(bits_equal(back.train.lr, x)) << deck::format_value(x);
  }
  EXPECT_EQ(deck::format_value(100.0), "100.0");
  EXPECT_EQ(deck::format_value(-2.5), "-2.5");
  EXPECT_EQ(deck::format_value(1e16), "1e+16");
  EXPECT_EQ(deck::format_value(1234567890123456.0), "1234567890123456.0");
  EXPECT_EQ(deck::format_value(1e-8), "1e-08");
  EXPECT_EQ(deck::format_value(-0.0), "-0.0");
  EXPECT_EQ(deck::format_value(3e-4), "0.0003");
  EXPECT_EQ(deck::format_value(std::string("it's")), "'it''s'");
}

TEST(DeckEcho, ExampleDecksRoundTrip) {
  std::string dir = PTRAIN_SOURCE_DIR "/input";
  int decks = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      std::string name = e->d_name;
      if (name.size() < 4 || name.compare(name.size() - 4, 4, ".nml") != 0) continue;
      Config c = deck::parse_file(dir + "/" + name);
      Config back = deck::parse_text(deck::echo(c), c.deck_path);
      EXPECT_TRUE(deck::same_values(c, back)) << name;
      ++decks;
    }
    closedir(d);
  }
  std::printf("round-tripped %d deck(s) from %s\n", decks, dir.c_str());
}

TEST(DeckHelp, ListsEveryGroupAndKey) {
  std::string help = deck::help_deck();
  for (const auto& g : deck::group_specs())
    EXPECT_NE(help.find("## &" + g.name + "\n"), std::string::npos) << g.name;
  for (const auto& s : deck::key_specs())
    EXPECT_NE(help.find("| `" + s.key + "` |"), std::string::npos) << s.name();
  EXPECT_NE(help.find("| `dtype` | string | `'fp32'` | `'fp32'`, `'fp64'`, `'bf16'` |"),
            std::string::npos);
  EXPECT_NE(help.find("| `zero` | integer | `0` | 0 to 3 |"), std::string::npos);
  EXPECT_NE(help.find("| `order` | string(5) | `'t', 'c', 'e', 'd', 'p'` |"), std::string::npos);
}

// --- MPI load ---------------------------------------------------------------------

class DeckLoad : public testing::Test {
 protected:
  void SetUp() override { dir_ = shared_temp_dir(); }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) {
      for (const std::string& f : files_) std::remove(f.c_str());
      rmdir(dir_.c_str());
    }
  }
  std::string deck(const std::string& name, const std::string& text) {
    std::string path = dir_ + "/" + name;
    if (world_rank() == 0) write_file(path, text);
    files_.push_back(path);
    MPI_Barrier(MPI_COMM_WORLD);
    return path;
  }
  // load's error message; expects the same on every rank.
  std::string load_error(const std::string& path, const std::vector<std::string>& overrides = {}) {
    std::string mine = error_of([&] { deck::load(MPI_COMM_WORLD, path, overrides, world_size()); });
    EXPECT_EQ(bcast_string(mine), mine);
    return mine;
  }
  std::string dir_;
  std::vector<std::string> files_;
};

TEST_F(DeckLoad, EveryRankGetsTheSameConfig) {
  std::string path =
      deck("good.nml",
           "&model n_layer = 8 /\n&train global_batch = 32, micro_batch = 2, lr = 1.5d-3 /\n");
  Config c =
      deck::load(MPI_COMM_WORLD, path, {"run%name=loaded", "train%min_lr=0.1"}, world_size());
  EXPECT_EQ(c.parallel.dp, world_size());
  EXPECT_EQ(c.model.n_layer, 8);
  EXPECT_EQ(c.run.name, "loaded");
  EXPECT_TRUE(bits_equal(c.train.lr, 1.5e-3));
  EXPECT_TRUE(bits_equal(c.train.min_lr, 0.1));
  EXPECT_EQ(c.deck_path, path);
  std::string mine = deck::echo(c);
  EXPECT_EQ(bcast_string(mine), mine);
  // The same as reading it here and validating by hand.
  Config here = deck::parse_file(path, {"run%name=loaded", "train%min_lr=0.1"});
  deck::validate(here, world_size());
  EXPECT_TRUE(deck::same_values(c, here));
}

TEST_F(DeckLoad, ParseErrorOnEveryRank) {
  std::string path = deck("bad.nml", "&model\n  n_layr = 8\n/\n");
  EXPECT_EQ(load_error(path),
            path + ":2:3: unknown key 'n_layr' in &model (did you mean 'n_layer'?)");
}

TEST_F(DeckLoad, MissingFileOnEveryRank) {
  std::string path = dir_ + "/missing.nml";
  EXPECT_EQ(load_error(path), "cannot open deck '" + path + "': No such file or directory");
}

TEST_F(DeckLoad, ValidationErrorOnEveryRank) {
  std::string path = deck("grid.nml", "&parallel dp = 3 /\n");
  EXPECT_EQ(load_error(path),
            cat(path, ": parallel%dp*tp*pp*cp*ep = 3*1*1*1*1 = 3 does not match the world size ",
                world_size()));
}

TEST_F(DeckLoad, OverrideErrorOnEveryRank) {
  std::string path = deck("ok.nml", "&run steps = 3 /\n");
  EXPECT_EQ(load_error(path, {"parallel%tpp=2"}),
            "--set parallel%tpp=2: unknown key 'tpp' in &parallel (did you mean 'tp'?)");
}
