// ptrain-test: np=1 labels=quick timeout=120
// gfortran as the oracle of the namelist grammar: a Fortran program generated from the
// schema table declares every group as a NAMELIST, reads a deck with READ(nml=...) and
// prints every value; the deck parser must return exactly the same values.
// Skipped when gfortran is not installed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "deck/deck.hpp"
#include "util/error.hpp"

using namespace ptrain;

namespace {

std::string fortran_literal(const deck::Value& v) {
  switch (static_cast<deck::KeyType>(v.index())) {
    case deck::KeyType::Int:
      return std::to_string(std::get<std::int64_t>(v)) + "_int64";
    case deck::KeyType::Real: {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.17e_real64", std::get<double>(v));
      return buf;
    }
    case deck::KeyType::Bool:
      return std::get<bool>(v) ? ".true." : ".false.";
    case deck::KeyType::Str: {
      std::string out = "'";
      for (char c : std::get<std::string>(v)) out += c == '\'' ? std::string("''") : std::string(1, c);
      return out + "'";
    }
  }
  return "";
}

// One subroutine per group (so equal key names in two groups cannot clash): declare the
// keys, set the schema defaults, READ the namelist, print "group%key(i)=value" lines.
// Integers print as I0, reals as their 64 bits (exact), logicals as T/F, strings in [].
std::string fortran_program() {
  const Config d = deck::defaults();
  const auto& specs = deck::key_specs();
  std::ostringstream f;
  f << "program deck_oracle\n  implicit none\n  character(len=4096) :: zz_path\n"
    << "  call get_command_argument(1, zz_path)\n";
  for (const auto& g : deck::group_specs()) f << "  call read_" << g.name << "(trim(zz_path))\n";
  f << "end program deck_oracle\n\n";
  for (const auto& g : deck::group_specs()) {
    f << "subroutine read_" << g.name << "(zz_path)\n"
      << "  use iso_fortran_env, only: int64, real64\n  implicit none\n"
      << "  character(len=*), intent(in) :: zz_path\n"
      << "  integer :: zz_u, zz_ios, zz_i\n  character(len=512) :: zz_msg\n";
    std::string names;
    for (int k : g.keys) {
      const deck::KeySpec& s = specs[static_cast<std::size_t>(k)];
      const char* type = s.type == deck::KeyType::Int    ? "integer(int64)"
                         : s.type == deck::KeyType::Real ? "real(real64)"
                         : s.type == deck::KeyType::Bool ? "logical"
                                                         : "character(len=256)";
      f << "  " << type << " :: " << s.key;
      if (s.extent > 0) f << "(" << s.extent << ")";
      f << "\n";
      names += (names.empty() ? "" : ", ") + s.key;
    }
    f << "  namelist /" << g.name << "/ " << names << "\n";
    for (int k : g.keys) {
      const deck::KeySpec& s = specs[static_cast<std::size_t>(k)];
      for (int i = 0; i < s.size(); ++i)
        f << "  " << s.key << (s.extent > 0 ? cat("(", i + 1, ")") : "") << " = " << fortran_literal(s.get(d, i))
          << "\n";
    }
    f << "  open(newunit=zz_u, file=zz_path, status='old', action='read')\n"
      << "  read(zz_u, nml=" << g.name << ", iostat=zz_ios, iomsg=zz_msg)\n"
      << "  close(zz_u)\n"
      << "  if (zz_ios > 0) then\n"
      << "    write(*,'(A)') 'error reading &" << g.name << ": ' // trim(zz_msg)\n"
      << "    stop 1\n  end if\n";
    for (int k : g.keys) {
      const deck::KeySpec& s = specs[static_cast<std::size_t>(k)];
      std::string var = s.key, loop_end;
      std::string head = "'" + s.name() + "='", fmt = "A,";  // write(*,'(fmt...)') head, value
      if (s.extent > 0) {
        f << "  do zz_i = 1, " << s.extent << "\n";
        var += "(zz_i)";
        head = "'" + s.name() + "(', zz_i, ')='";
        fmt = "A,I0,A,";
        loop_end = "  end do\n";
      }
      switch (s.type) {
        case deck::KeyType::Int:
          f << "  write(*,'(" << fmt << "I0)') " << head << ", " << var << "\n";
          break;
        case deck::KeyType::Real:
          f << "  write(*,'(" << fmt << "I0)') " << head << ", transfer(" << var << ", 0_int64)\n";
          break;
        case deck::KeyType::Bool:
          f << "  write(*,'(" << fmt << "L1)') " << head << ", " << var << "\n";
          break;
        case deck::KeyType::Str:
          f << "  write(*,'(" << fmt << "A)') " << head << ", '[' // trim(" << var << ") // ']'\n";
          break;
      }
      f << loop_end;
    }
    f << "end subroutine read_" << g.name << "\n\n";
  }
  return f.str();
}

// Our parser's values in the oracle's output format.
std::map<std::string, std::string> our_values(const Config& c) {
  std::map<std::string, std::string> out;
  for (const deck::KeySpec& s : deck::key_specs()) {
    for (int i = 0; i < s.size(); ++i) {
      std::string label = s.extent > 0 ? cat(s.name(), "(", i + 1, ")") : s.name();
      deck::Value v = s.get(c, i);
      switch (s.type) {
        case deck::KeyType::Int:
          out[label] = std::to_string(std::get<std::int64_t>(v));
          break;
        case deck::KeyType::Real: {
          double x = std::get<double>(v);
          std::int64_t bits;
          std::memcpy(&bits, &x, sizeof bits);
          out[label] = std::to_string(bits);
          break;
        }
        case deck::KeyType::Bool:
          out[label] = std::get<bool>(v) ? "T" : "F";
          break;
        case deck::KeyType::Str: {
          std::string str = std::get<std::string>(v);
          while (!str.empty() && str.back() == ' ') str.pop_back();  // Fortran's trim()
          out[label] = "[" + str + "]";
          break;
        }
      }
    }
  }
  return out;
}

class DeckFortran : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (std::system("gfortran --version > /dev/null 2>&1") != 0) return;
    char tmpl[] = "/tmp/ptrain_deck_fortran_XXXXXX";
    if (!mkdtemp(tmpl)) return;
    dir_ = tmpl;
    std::ofstream(dir_ + "/oracle.f90") << fortran_program();
    std::string cmd = "cd " + dir_ + " && gfortran -ffree-line-length-none -o oracle oracle.f90 > compile.log 2>&1";
    compiled_ = std::system(cmd.c_str()) == 0;
  }
  static void TearDownTestSuite() {
    if (!dir_.empty()) std::system(("rm -rf " + dir_).c_str());
  }
  void SetUp() override {
    if (dir_.empty()) GTEST_SKIP() << "gfortran not found: the namelist oracle is skipped";
    ASSERT_TRUE(compiled_) << "the generated Fortran oracle does not compile; see " << dir_ << "/compile.log";
  }

  // Runs the oracle on `deck`; returns label -> value.
  std::map<std::string, std::string> oracle(const std::string& deck) {
    std::ofstream(dir_ + "/deck.nml", std::ios::binary) << deck;
    std::map<std::string, std::string> out;
    std::FILE* p = popen((dir_ + "/oracle " + dir_ + "/deck.nml 2>&1").c_str(), "r");
    if (!p) return out;
    char line[4096];
    while (std::fgets(line, sizeof line, p)) {
      std::string l = line;
      while (!l.empty() && (l.back() == '\n' || l.back() == '\r')) l.pop_back();
      std::size_t eq = l.find('=');
      if (eq == std::string::npos) {
        ADD_FAILURE() << "oracle: " << l;
        continue;
      }
      out[l.substr(0, eq)] = l.substr(eq + 1);
    }
    EXPECT_EQ(pclose(p), 0) << "gfortran could not read the deck:\n" << deck;
    return out;
  }

  void expect_same(const std::string& deck) {
    std::map<std::string, std::string> want = oracle(deck);
    std::map<std::string, std::string> got = our_values(deck::parse_text(deck, "deck.nml"));
    ASSERT_EQ(want.size(), got.size()) << deck;
    for (const auto& [label, value] : want) EXPECT_EQ(got[label], value) << label << " in deck:\n" << deck;
  }

  static std::string dir_;
  static bool compiled_;
};
std::string DeckFortran::dir_;
bool DeckFortran::compiled_ = false;

}  // namespace

TEST_F(DeckFortran, DefaultsAgree) { expect_same("! no groups at all\n"); }

TEST_F(DeckFortran, F90nmlOutput) {
  expect_same(
      "&run\n    name = 'f90nml'\n    seed = 42\n    trace = .true.\n/\n\n"
      "&model\n    n_layer = 4\n    d_model = 256\n    dtype = 'fp32'\n    capacity_factor = 1.5\n/\n\n"
      "&parallel\n    order = 'd', 't', 'c', 'e', 'p'\n    bucket_mb = 0.001\n/\n\n"
      "&train\n    lr = 0.0003\n    eps = 1e-08\n    beta2 = 0.999\n/\n");
}

TEST_F(DeckFortran, UppercaseAndFortranReals) {
  expect_same(
      "&MODEL\n  N_LAYER = 8, D_MODEL = 64\n  DTYPE = 'fp64'\n/\n"
      "&TRAIN LR = 1.0D-3, MIN_LR = 1.D0, BETA1=.5, WEIGHT_DECAY = 2\n"
      "  BETA2 = +9.5E-1, EPS = 3e-4, CLIP = 2., OPTIMIZER = \"sgd\" /\n"
      "&Backend Peak_Gflops = 1.5e+3 , blas_threads=+3 /\n");
  expect_same("&model capacity_factor = -0. /\n&data val_fraction = 1e-1 /\n&backend peak_gflops = 7 /\n");
  expect_same("&train lr = 0.1000000000000000055511151231257827, eps = 2.2250738585072014d-308 /\n");
}

TEST_F(DeckFortran, EndTerminatorCommentsAndTextOutsideGroups) {
  expect_same(
      "This deck is read by gfortran and by ptrain.\n"
      "Lines outside groups are ignored.\n"
      "&run ! the run\n"
      "  steps = 7   ! seven\n"
      "\n"
      "  name = 'x!y/z' , out_dir = \"a/b\"\n"
      "&end\n"
      "more text\n"
      "&data source = 'bytes', path = 'input.txt', val_fraction = 0.25 /\n");
}

TEST_F(DeckFortran, Logicals) {
  const char* forms[][4] = {{".true.", ".false.", "T", "F"},
                            {".t.", ".f.", "true", "false"},
                            {".TRUE.", "f", "t", ".FALSE."},
                            {".tomato", ".fig", "Tuesday", "F"}};
  for (auto& f : forms)
    expect_same(cat("&run trace = ", f[0], " /\n&parallel sequence_parallel = ", f[1], ", strict_topology = ", f[2],
                    " /\n&checkpoint save_final = ", f[3], " /\n"));
}

TEST_F(DeckFortran, Strings) {
  expect_same(
      "&run name = 'it''s', out_dir = \"say \"\"hi\"\"\" /\n"
      "&model init_from = \"a'b\" /\n"
      "&checkpoint dir = '', restart = 'latest' /\n");
}

TEST_F(DeckFortran, IntegersAndSigns) {
  expect_same("&run seed = +42, steps = 0, log_every = 1*5 /\n&parallel dp = -1, tp = +2 /\n");
  expect_same("&parallel dp = 4 /\n&run seed = 9223372036854775807 /\n");
}

TEST_F(DeckFortran, Arrays) {
  expect_same("&parallel order = 'p' 'd' 'e' 'c' 't' /\n");
  expect_same("&parallel order = 'p',\n   'd', 'e',\n   'c', 't' /\n");
  expect_same("&parallel order(2) = 'd' /\n");
  expect_same("&parallel order(4) = 'c', 'c' /\n");
  expect_same("&parallel order = 2*'t', 3*'c' /\n");
  expect_same("&parallel order = , 'p', , 'e' /\n");
  expect_same("&parallel order = 2*, 'd' /\n");
  expect_same("&parallel order(1) = 'd', order(5) = 't' /\n");
  expect_same("&parallel order = 'p',,,,, /\n");
}

TEST_F(DeckFortran, NullsSeparatorsAndGroupOrder) {
  expect_same("&model n_layer=2,d_model=64,n_head=8/\n");
  expect_same("&model n_layer = 6, d_model = , n_head = 2 /\n");
  expect_same("&train micro_batch=2 / &model n_layer=3 / &run steps=1 /\n");
  expect_same("&backend\n\tdevice = 'cpu'\n\tblas_threads = 2\n/\n&run\n\ttrace = T\n/\n");
  expect_same("&model\r\n  n_layer = 2\r\n  dtype = 'fp64'\r\n/\r\n");
}

TEST_F(DeckFortran, ExampleDecks) {
  // Every deck shipped in input/ reads the same in gfortran.
  std::string dir = PTRAIN_SOURCE_DIR "/input";
  std::FILE* ls = popen(("ls " + dir + "/*.nml 2>/dev/null").c_str(), "r");
  ASSERT_TRUE(ls);
  char line[4096];
  while (std::fgets(line, sizeof line, ls)) {
    std::string path = line;
    while (!path.empty() && path.back() == '\n') path.pop_back();
    std::ifstream f(path, std::ios::binary);
    std::stringstream text;
    text << f.rdbuf();
    SCOPED_TRACE(path);
    expect_same(text.str());
  }
  pclose(ls);
}

TEST_F(DeckFortran, OracleSeesTheDeck) {
  // The oracle itself reads values (so agreement above is not two defaults agreeing).
  auto out = oracle("&model n_layer = 7 /\n&train lr = 1.0d-3 /\n&parallel order(3) = 'p' /\n&run name='it''s' /\n");
  EXPECT_EQ(out["model%n_layer"], "7");
  double lr = 1.0e-3;
  std::int64_t bits;
  std::memcpy(&bits, &lr, sizeof bits);
  EXPECT_EQ(out["train%lr"], std::to_string(bits));
  EXPECT_EQ(out["parallel%order(3)"], "[p]");
  EXPECT_EQ(out["run%name"], "[it's]");
  EXPECT_EQ(out["model%d_model"], "128");
  EXPECT_EQ(out.size(), our_values(deck::defaults()).size());
}
