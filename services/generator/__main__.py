from reinforce.generator.main import main

main()
